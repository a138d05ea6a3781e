"""mypy over the compiler core (the files pyproject.toml's [tool.mypy] lists, named as
an install names them: tools/typecheck.py): the test command fails on a finding, so
CI runs the type checker. And the recognizer protocol's type does its job: a caller
that tests a recognizer's answer for None alone, and reads the match's fields, is
told it may hold a Miss; the `if not m` idiom passes. Both runs share mypy's cache
(.mypy_cache): about 30 s of CPU when it is cold, a few seconds when warm."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _typecheck(*args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("mypy") is None:
        msg = "mypy is not installed: pip install -e '.[test]' (install.sh does)"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return subprocess.run([sys.executable, str(ROOT / "tools" / "typecheck.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy_finds_nothing():
    proc = _typecheck()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


FORGETS_THE_MISS = '''
from commfold.patterns.gather import VocabGather
from commfold.patterns.greedy import match_greedy


def picked(g: VocabGather) -> str:
    m = match_greedy(g)
    if m is None:
        return "none"
    return m.pick.name
'''

HANDS_IT_ON = '''
from commfold.patterns.common import Miss, Recognized
from commfold.patterns.greedy import GreedyPick, match_greedy
from commfold.patterns.gather import VocabGather


def picked(g: VocabGather) -> Recognized[str]:
    m: Recognized[GreedyPick] = match_greedy(g)
    if not m:
        return m
    return m.pick.name


def reason(m: Recognized[GreedyPick]) -> str:
    return m.reason if isinstance(m, Miss) else "matched or nothing"
'''


def test_a_forgotten_miss_is_a_type_error(tmp_path):
    (tmp_path / "forgets_the_miss.py").write_text(FORGETS_THE_MISS)
    (tmp_path / "hands_it_on.py").write_text(HANDS_IT_ON)
    proc = _typecheck("patterns", str(tmp_path / "forgets_the_miss.py"),
                      str(tmp_path / "hands_it_on.py"))
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert proc.returncode == 1, out[-5000:]
    assert len(errors) == 1, out[-5000:]
    assert "forgets_the_miss.py:10: error:" in errors[0]
    assert 'Item "Miss" of "GreedyPick | Miss" has no attribute "pick"' in errors[0]
