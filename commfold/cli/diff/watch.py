"""The parent's watchdog over the ranks of `commfold diff`: print each rank's stage as
it changes, stop every rank when one fails or the run passes its timeout, and say
why in one line."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from commfold.distributed.ranks import peer_left


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _cause(log: Path) -> str:
    """The exception line of a rank's traceback (the last 'X: msg' after a Traceback)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    start = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback")), default=None)
    if start is None:
        return _last_line(log) or "no output"
    tail = [ln for ln in lines[start:] if ln and not ln.startswith((" ", "\t", "Traceback"))]
    return tail[-1].strip() if tail else lines[-1].strip()


def _new_stages(progress: Path, seen: dict) -> list[str]:
    """Stages a rank logged since the last call (seen[path] = lines already read)."""
    try:
        text = progress.read_text(errors="replace")
    except OSError:
        return []
    done = seen.get(progress, 0)
    complete = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    seen[progress] = max(done, len(complete))
    return [ln.split("s ", 1)[1] if "s " in ln else ln for ln in complete[done:]]


def kill(p: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(p.pid, signal.SIGKILL)  # the rank and any compile workers it started
    except (ProcessLookupError, PermissionError):
        p.kill()
    p.wait(timeout=10)


def watch(procs, out_dir: Path, timeout: float, echo) -> str | None:
    """Print each rank's stage as it changes; return None when all ranks exit 0,
    else a one-line cause (the others are killed: they may wait in a collective). A
    rank that failed only because a peer left its collective is a consequence: the
    cause named is another failed rank's, where one fails within the grace period."""
    t0, last, seen = time.monotonic(), {}, {}
    grace_until = None
    failures: dict[int, str] = {}  # rank -> its exception line, in the order seen
    while True:
        now = time.monotonic() - t0
        for r, p in enumerate(procs):
            code = p.poll()
            stages = _new_stages(out_dir / f"rank{r}" / "progress.log", seen)
            if code not in (None, 0):
                stages.append(f"FAILED (exit {code})")
            for stage in stages:
                if last.get(r) != stage:
                    last[r] = stage
                    echo(f"[{now:6.1f}s] rank {r}: {stage}")
            if code not in (None, 0) and r not in failures:
                failures[r] = _cause(out_dir / f"rank{r}" / "log.txt")
                grace_until = grace_until or time.monotonic() + 5.0
        if all(p.poll() == 0 for p in procs):
            return None
        if failures and (all(p.poll() is not None for p in procs)
                         or time.monotonic() > grace_until):
            r = next((r for r, cause in failures.items() if not peer_left(cause)),
                     next(iter(failures)))
            return f"rank {r} failed: {failures[r]} (log: {out_dir / f'rank{r}' / 'log.txt'})"
        if now > timeout:
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            where = "; ".join(f"rank {r} in '{last.get(r)}'" for r in hung)
            return (f"rank(s) {hung} still running after {timeout:.0f}s (hung?): {where} "
                    f"(logs: {out_dir}/rank*/log.txt)")
        time.sleep(0.2)
