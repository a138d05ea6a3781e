"""`commfold diff`: run a program on N CPU ranks under commfold and dump what each
pass did to each post-grad graph.

How a target runs under commfold (each rank is a fresh `python` process):
- every rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=
  127.0.0.1, MASTER_PORT). A script is run as ``__main__`` and initializes its own
  process group (``dist.init_process_group("gloo")``), exactly as under torchrun;
  a ``module:function`` is called with no arguments after the rank has initialized
  the default gloo group;
- Inductor's ``post_grad_custom_post_pass`` is set to a CommfoldPass, so a plain
  ``torch.compile(model)`` runs commfold; and ``commfold.manager.observing`` forces
  the chosen passes on every CommfoldPass (also those of ``backend="commfold"``)
  and reports each pass's graph before and after to a Recorder that writes dumps
  immediately (kept if a rank later fails). Observed passes bypass Inductor's cache;
- the whole run is wrapped in ``depyf.prepare_debug`` for the decompiled dynamo code.

Layout of the output directory:
    summary.txt                        the table printed at the end
    rank<r>/log.txt                    the rank's stdout and stderr
    rank<r>/progress.log               the stages the rank went through
    rank<r>/report.json                every graph's rewrites / near-misses / errors
    rank<r>/graph<g>/<NN>_<pass>.before.py, .after.py, .diff, and report.txt
    rank<r>/depyf/                     depyf: full_code_for_*.py, __transformed_code_*,
                                       __compiled_fn_* (dynamo graph, AOT, kernels)

Modules: target (what to run), rank (inside a rank: the observer that writes the
dumps), watch (the parent's watchdog), summary (the table), render (graphs as
text); this one starts the ranks and ties them together.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from commfold.cli.diff.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RANK_FAILED, DiffError
from commfold.cli.diff.summary import load_reports, summary
from commfold.cli.diff.target import Target
from commfold.cli.diff.watch import kill, watch

__all__ = ["DiffError", "EXIT_BAD_INPUT", "EXIT_OK", "EXIT_RANK_FAILED", "run_diff"]


def run_diff(target: str, world_size: int = 2, out: str = "commfold-diff",
             passes: list[str] | None = None, timeout: float = 600.0,
             echo=print) -> int:
    """Run `target` on `world_size` ranks under commfold, write the dumps, print the
    summary. Returns the exit code (0 ok, 1 a rank failed or hung, 2 bad input)."""
    try:
        return _run(target, world_size, out, passes, timeout, echo)
    except DiffError as e:
        echo(f"commfold diff: error: {e}")
        return e.code


def _run(target_text, world_size, out, passes, timeout, echo) -> int:
    from commfold.config import ALL_PASSES, unknown_passes
    from commfold.distributed.ranks import free_port

    target = Target.parse(target_text)
    if world_size < 1:
        raise DiffError("--world-size must be at least 1", EXIT_BAD_INPUT)
    passes = list(passes) if passes else list(ALL_PASSES)
    unknown = unknown_passes(passes)
    if unknown:
        raise DiffError(f"unknown pass(es) {unknown}; registered: {list(ALL_PASSES)}",
                        EXIT_BAD_INPUT)
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = json.dumps({"target": dataclasses.asdict(target), "out": str(out_dir),
                       "passes": passes})
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    echo(f"commfold diff: {target} on {world_size} CPU rank(s), passes {','.join(passes)}, "
         f"dumps in {out_dir}")
    procs, logs = [], []
    echo(f"[   0.0s] starting {world_size} rank process(es) (importing torch takes a few seconds)")
    (out_dir / "summary.txt").unlink(missing_ok=True)
    for r in range(world_size):
        shutil.rmtree(out_dir / f"rank{r}", ignore_errors=True)  # no stale dumps
        (out_dir / f"rank{r}").mkdir()
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                   TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        log = open(out_dir / f"rank{r}" / "log.txt", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "import sys; from commfold.cli.diff.rank import rank_main; "
                                   "rank_main(sys.argv[1])", spec],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        failed = watch(procs, out_dir, timeout, echo)
    finally:
        for p in procs:
            if p.poll() is None:
                kill(p)
        for log in logs:
            log.close()
    if failed:
        raise DiffError(failed + f" (dumps so far kept in {out_dir})", EXIT_RANK_FAILED)
    graphs = [load_reports(out_dir / f"rank{r}" / "report.json") for r in range(world_size)]
    if not any(graphs):
        raise DiffError(f"{target} compiled nothing with Inductor: no torch.compile call ran "
                        "(or it used a non-Inductor backend), so there is nothing to diff",
                        EXIT_BAD_INPUT)
    text = summary(graphs, out_dir)
    (out_dir / "summary.txt").write_text(text + "\n")
    echo(text)
    return EXIT_OK
