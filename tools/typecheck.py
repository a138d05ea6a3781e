"""mypy over the files pyproject.toml's [tool.mypy] lists, with the module names an
install gives them: passes/ and patterns/ are commfold.passes and commfold.patterns
(pyproject's [tool.setuptools.package-dir]), and the code imports them by those
names. mypy names a file by the folders it sits in (passes.local_argmax), so a plain
`mypy` run would see two modules per file; this names each source as setuptools
maps it, then runs mypy's own build. Exit status and output are mypy's.

    python3 tools/typecheck.py            # the configured files
    python3 tools/typecheck.py passes/    # other files or folders (the checkout's), same settings
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build

if sys.version_info >= (3, 11):
    import tomllib
else:  # mypy depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, str]:
    """Source folder -> package name, for the folders whose name is not the package's
    ({'passes': 'commfold.passes', 'patterns': 'commfold.patterns'})."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {folder: package for package, folder in mapping.items() if folder != package}


def module_name(module: str, dirs: dict[str, str]) -> str:
    """mypy's folder-derived name of a source, renamed as the install names it."""
    head, dot, rest = module.partition(".")
    return dirs[head] + dot + rest if head in dirs else module


def main(argv: list[str]) -> int:
    os.chdir(ROOT)  # the config's paths, and the cache, are the checkout's
    t0 = time.time()
    fscache = FileSystemCache()
    sources, options = process_options(argv, fscache=fscache)
    dirs = package_dirs()
    for source in sources:
        name = module_name(source.module, dirs)
        if name != source.module:
            source.module, source.base_dir = name, str(ROOT)
    _, messages, blockers = run_build(sources, options, fscache, t0, sys.stdout, sys.stderr)
    n_errors, n_notes, n_files = util.count_stats(messages)
    took = f"{time.time() - t0:.1f} s"
    if n_errors:
        print(f"Found {n_errors} errors in {n_files} files "
              f"(checked {len(sources)} source files, {took})")
        return 2 if blockers else 1
    print(f"Success: no issues found in {len(sources)} source files ({took})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
