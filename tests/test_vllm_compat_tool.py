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
