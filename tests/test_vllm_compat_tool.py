"""tools/vllm_compat.py finds a hook point in a vLLM source tree as getattr would -
through re-exports (absolute and relative) and base classes - without importing it,
and reports a point that is gone or no longer holds its text as moved (exit 1)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compat():
    spec = importlib.util.spec_from_file_location("vllm_compat", ROOT / "tools" / "vllm_compat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FILES = {
    "__init__.py": "",
    "_version.py": "__version__ = version = '9.1.0'\n",
    "config/__init__.py": "from vllm.config.vllm import VllmConfig\n",
    "config/vllm.py": "class Base:\n    def inherited(self):\n        return 1\n\n\n"
                      "class VllmConfig(Base):\n    flag: bool = False\n\n"
                      "    def __post_init__(self):\n        self.a = 1\n",
    "pkg/__init__.py": "from .mod import Thing\n",
    "pkg/mod.py": "class Thing:\n    def run(self):\n        x = compute()\n",
}


@pytest.fixture
def tree(tmp_path):
    for name, text in FILES.items():
        path = tmp_path / "vllm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "vllm"


@pytest.mark.parametrize("where,text,state", [
    ("vllm.config:VllmConfig.__post_init__", "self.a = 1", "present"),
    ("vllm.config:VllmConfig.inherited", None, "present"),
    ("vllm.config:VllmConfig.flag", None, "present"),
    ("vllm.pkg:Thing.run", "x = compute()", "present"),
    ("vllm.config:VllmConfig.__post_init__", "self.b = 2", "moved: `self.b = 2` not in it"),
    ("vllm.config:VllmConfig.gone", None, "moved (VllmConfig has no gone)"),
    ("vllm.nowhere:X", None, "moved (no module vllm.nowhere)"),
])
def test_points_found_statically(compat, tree, where, text, state):
    assert compat.check(compat.Sources(tree), where, text) == state


def test_a_tree_without_commfolds_hook_points_fails(compat, tree, tmp_path, capsys):
    out = tmp_path / "compat.md"
    assert compat.main([str(tree.parent), "--out", str(out)]) == 1
    assert "| vllm 9.1.0 |" in capsys.readouterr().out
    assert "moved" in out.read_text()


METHOD = ('class Sampler:\n    @staticmethod\n    def pick(x):\n        """Doc."""\n'
          '        y = x + 1\n\n        return y\n')


def test_a_pinned_point_holds_the_same_hash_statically_and_imported(compat, tree,
                                                                    monkeypatch):
    """A pinned point: the whole function's source by hash, the same from the parsed
    file (tools/vllm_compat.py) as from the imported function (at plugin load), held
    only for the release the vLLM is read as (another release's pin of the same
    source does not count), and any change to the function reads as moved."""
    import importlib.util
    import inspect
    import sys

    from commfold.vllm.compat import releases
    from commfold.vllm.compat.hook_points import Pinned, missing, source_hash

    path = tree / "sampler.py"
    path.write_text(METHOD)
    spec = importlib.util.spec_from_file_location("sampler_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    digest = source_hash(inspect.getsource(module.Sampler.pick))
    # this process read as the newest claimed release (vLLM itself need not be installed)
    newest = releases.newest()
    monkeypatch.setattr(releases, "here",
                        lambda: releases.here_for((newest.distribution, newest.version)))
    here = newest.version
    pinned = Pinned(((here, digest),))
    # at load: the imported function against its pin
    sys.modules["sampler_for_test"] = module
    try:
        assert missing((("sampler_for_test:Sampler.pick", pinned),)) == []
        for other in (Pinned(((here, "0" * 16),)), Pinned((("0.1.0", digest),))):
            (line,) = missing((("sampler_for_test:Sampler.pick", other),))
            assert line.startswith("sampler_for_test:Sampler.pick changed (source hash ")
            assert f"not {here}'s, read for {other.releases()}" in line
    finally:
        del sys.modules["sampler_for_test"]
    # statically, as tools/vllm_compat.py reads a release (9.1.0: read as the newest
    # claimed release): the same hash, and only that release's pin holds
    assert compat.check(compat.Sources(tree), "vllm.sampler:Sampler.pick", pinned) == "present"
    oldest = releases.claimed()[0].version
    assert compat.check(compat.Sources(tree), "vllm.sampler:Sampler.pick",
                        Pinned(((oldest, digest),))).startswith("moved")
    path.write_text(METHOD.replace("x + 1", "x + 2"))
    moved = compat.check(compat.Sources(tree), "vllm.sampler:Sampler.pick", pinned)
    assert moved.startswith("moved: source hash ") and digest not in moved


def test_a_hook_for_other_releases_is_marked_not_moved(compat, tree):
    """Rows of a V1 hook in a release without the V1 runner, and of a hook set that
    covers other releases, say so instead of "moved" (the exit status counts moved)."""
    assert compat._v1_runner(compat.Sources(tree)) == "- (no V1 runner)"
    sets = [h for h in compat.hooks.HOOKS if (h.since or h.until)  # the V2 target pick's
            and h.name == "target pick"]
    src = compat.Sources(tree)  # vLLM 9.1.0: the newest set
    assert [compat._in_range(s)(src) for s in sets] == ["- (another set)", None]


def test_rows_are_the_registrys_points(compat, tree):
    """One row per point of every hook in commfold.vllm.compat.hooks.HOOKS, under its label."""
    from commfold.vllm.compat import hooks

    rows = compat.report([compat.Sources(tree)])
    for hook in hooks.HOOKS:
        assert compat.HOOKS[hook.label()] == hook.points
        assert sum(row.startswith(f"| {hook.label()} | ") for row in rows) == len(hook.points)
