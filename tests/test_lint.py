"""ruff over the tree, with pyproject.toml's [tool.ruff] rules: the test command fails on
a finding (line length, unused or unsorted imports, likely bugs), so CI runs the linter."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    if importlib.util.find_spec("ruff") is None:
        msg = "ruff is not installed: pip install -e '.[test]' (install.sh does)"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
