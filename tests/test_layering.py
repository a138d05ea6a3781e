"""The layering, checked by import-linter with pyproject.toml's [tool.importlinter]
contracts: patterns import no passes and no manager, passes import no manager, only
commfold.vllm imports vLLM, the shard math (commfold.shard) imports neither vLLM nor
commfold.vllm, and the installed package imports none of the checkout's scaffolding
(harness/, benchmarks/, tools/, examples/ are not installed). Every import
statement counts, also one inside a function or under `if TYPE_CHECKING:`; a module
reached only by a name in a string (importlib.import_module(name), sys.modules.get(name),
vLLM resolving "commfold.vllm_pass") is no import, and no contract sees it.

import-linter finds a package's modules by walking its folder, and in the checkout
passes/ and patterns/ sit beside commfold/ (pyproject's package-dir): the check runs on
a copy laid out as installed, commfold/passes and commfold/patterns inside commfold/."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> its folder in the installed package (pyproject's package-dir)
LAYOUT = {"commfold": "commfold", "passes": "commfold/passes", "patterns": "commfold/patterns"}
# one import per contract that breaks it: file in the installed layout -> its text
PLANTED = {
    "commfold/patterns/_planted.py": "def f():\n    from ..passes import PASSES\n",
    "commfold/passes/_planted.py": "import commfold.manager\n",
    "commfold/fx/_planted.py": "def f():\n    import vllm.config\n",
    "commfold/_planted.py": "from harness import vllm_models\n",
    "commfold/shard/_planted.py": "def f():\n    from commfold.vllm.target import switch\n",
}


def installed_layout(dest: Path) -> Path:
    for src, target in LAYOUT.items():
        shutil.copytree(ROOT / src, dest / target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def lint(tree: Path) -> dict[str, str]:
    """{contract name: KEPT or BROKEN}, import-linter run in a fresh interpreter on `tree`
    (this process imported the checkout's commfold, which import-linter would find)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = ("import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports("
            f"config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)
    verdicts = dict(re.findall(r"^(.+?) (KEPT|BROKEN)$", proc.stdout, re.MULTILINE))
    assert verdicts and proc.returncode == (0 if "BROKEN" not in verdicts.values() else 1), \
        (proc.stdout + proc.stderr)[-5000:]
    return verdicts


@pytest.fixture(scope="module")
def import_linter():
    if importlib.util.find_spec("importlinter") is None:
        msg = "import-linter is not installed: pip install -e '.[test]' (install.sh does)"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


def test_contracts_kept(import_linter, tmp_path):
    verdicts = lint(installed_layout(tmp_path))
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert len(verdicts) == contracts
    assert {name for name, v in verdicts.items() if v != "KEPT"} == set()


def test_each_contract_catches_its_import(import_linter, tmp_path):
    """An import planted against each contract breaks it: the contracts see passes/ and
    patterns/ under their installed names, relative imports and imports in functions."""
    tree = installed_layout(tmp_path)
    for path, text in PLANTED.items():
        (tree / path).write_text(text)
    verdicts = lint(tree)
    assert len(verdicts) == len(PLANTED)
    assert {name for name, v in verdicts.items() if v != "BROKEN"} == set()
