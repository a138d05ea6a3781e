"""tools/vllm_release_tier.py without its venv: the release and test modules it runs
come from the registry, its JSON holds exactly the test cases that ran (a deselected
test is counted, not listed) with what the graph step recorded, and
tools/vllm_compat.py renders that graph step in the classes column."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from commfold.vllm.compat import releases

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tier():
    return _tool("vllm_release_tier")


def test_the_tier_runs_the_registrys_release_and_its_modules(tier):
    release = releases.newest_verified("classes")
    assert release is not None and release.version == "0.34.0", release
    read = tier._releases().newest_verified("classes")  # by path: another class
    assert read.version == release.version
    assert tier.GRAPH_TEST in tier.TESTS
    missing = [m for m in tier.TESTS if not (ROOT / m).is_file()]
    assert missing == []


CASES = '''
import pytest


def test_ran():
    pass


@pytest.mark.slow
def test_slow():
    pass


def test_skipped():
    pytest.skip("not here")


def test_graph(record_property):
    record_property("graph", '{"sites": [], "numerics": "equal"}')
'''


def test_json_lists_only_what_ran(tier, tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    module = tmp_path / "test_tier_cases.py"
    module.write_text(CASES)
    rc, cases, deselected = tier.run_tests(venv, [str(module)], ["-m", "not slow"])
    assert rc == 0 and deselected == 1
    assert [(c["test"], c["outcome"]) for c in cases] == [
        ("test_ran", "passed"), ("test_skipped", "skipped"), ("test_graph", "passed")]
    assert cases[2]["properties"] == {"graph": {"sites": [], "numerics": "equal"}}
    assert "properties" not in cases[0]
    graph_module = [dict(c, module=tier.GRAPH_TEST) for c in cases[2:]]
    assert tier.graph_step(graph_module) == {
        "outcome": "passed", "test": "test_graph", "sites": [], "numerics": "equal"}
    assert tier.graph_step(cases)["outcome"] == "not run"


def test_compat_column_shows_the_graph_step():
    compat = _tool("vllm_compat")
    graph = {"outcome": "passed", "numerics": "tokens equal",
             "sites": [{"site": "all-reduce + RMSNorm", "by": "fuse_allreduce_rmsnorm",
                        "matched": 2, "of": 2}]}
    tier = {"versions": {"vllm": "9.9.9"}, "covers": {}, "cases": [], "graph": graph}
    assert compat._tier_cell(tier, "graph passes", []) == (
        "graph passes: all-reduce + RMSNorm 2/2 (fuse_allreduce_rmsnorm) per graph; "
        "tokens equal")
    failed = dict(graph, outcome="failed", test="test_graph")
    assert compat._tier_cell(dict(tier, graph=failed), "graph passes", []) == \
        "graph passes: failed (test_graph)"
    assert compat._tier_cell(tier, "target pick (V2)", []) == "not run"  # its own rows
