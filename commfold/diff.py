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
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_RANK_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class DiffError(Exception):
    """Bad input or a failed run: one line for the user, and an exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- text
_DEAD_VARS = re.compile(r";\s+[\w\s=]+= None$")


def render(graph) -> str:
    """A post-grad graph as readable Python: typed, one op per line, each block
    headed by the user source line (file, line, code) that produced it."""
    src = graph.python_code(root_module="self", verbose=True).src
    lines = [_DEAD_VARS.sub("", line.rstrip()) for line in src.strip("\n").splitlines()]
    return "\n".join(lines) + "\n"


def unified(before: str, after: str, name: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        f"{name}.before.py", f"{name}.after.py", n=3))


# ----------------------------------------------------------------------- target
@dataclasses.dataclass(frozen=True)
class Target:
    """A script path (run as __main__) or module:function (called on each rank)."""

    script: str | None = None
    module: str | None = None
    function: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Target":
        if text.endswith(".py") or os.sep in text or os.path.exists(text):
            path = Path(text)
            if not path.is_file():
                raise DiffError(f"no such script: {text}", EXIT_BAD_INPUT)
            return cls(script=str(path.resolve()))
        module, sep, function = text.partition(":")
        if not sep or not module or not function:
            raise DiffError(f"target {text!r} is neither an existing .py file nor "
                            "module:function", EXIT_BAD_INPUT)
        import importlib.util

        sys.path.insert(0, os.getcwd())  # as in the ranks: modules beside the cwd import
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as e:
            spec, why = None, f" ({e})"
        else:
            why = ""
        finally:
            sys.path.pop(0)
        if spec is None:
            raise DiffError(f"no module named {module!r}{why}", EXIT_BAD_INPUT)
        return cls(module=module, function=function)

    def __str__(self) -> str:
        return self.script or f"{self.module}:{self.function}"


# ------------------------------------------------------------------ inside a rank
class Recorder:
    """The observer a rank installs: writes each pass's before/after/diff at once
    and keeps report.json current, so a later failure loses nothing."""

    def __init__(self, root: Path, progress):
        self.root, self.progress = root, progress
        self.graphs: list[dict] = []  # one per compiled graph, in compile order
        self._by_report: dict[int, dict] = {}

    def __call__(self, pass_name, before, after, report) -> None:
        try:
            self._record(pass_name, before, after, report)
        except Exception as e:  # a dump problem must not break the user's compile
            print(f"commfold diff: could not dump {pass_name}: {type(e).__name__}: {e}",
                  file=sys.stderr)

    def _record(self, pass_name, before, after, report) -> None:
        g = self._by_report.get(id(report))
        if g is None:
            from torch._guards import CompileContext

            compile_id = CompileContext.current_compile_id()
            g = {"graph": len(self.graphs), "compile_id": str(compile_id) if compile_id else "",
                 "passes": [], "_report": report}
            self._by_report[id(report)] = g
            self.graphs.append(g)
        # the manager reports each pass once the whole run succeeded: select by pass
        new_r = [r for r in report.rewrites if r.pass_name == pass_name]
        new_m = [m for m in report.near_misses if m.pass_name == pass_name]
        new_e = [e for e in report.errors if e.pass_name == pass_name]
        gdir = self.root / f"graph{g['graph']}"
        gdir.mkdir(parents=True, exist_ok=True)
        n = len(g["passes"])
        stem = f"{n:02d}_{pass_name}"
        where = f"graph {g['graph']} (compile {g['compile_id'] or '?'})"
        b, a = render(before), render(after)
        (gdir / f"{stem}.before.py").write_text(
            f"# {where}: post-grad graph BEFORE commfold pass {pass_name}\n{b}")
        (gdir / f"{stem}.after.py").write_text(
            f"# {where}: post-grad graph AFTER commfold pass {pass_name}\n{a}")
        (gdir / f"{stem}.diff").write_text(unified(b, a, stem) or f"# {pass_name}: no change\n")
        g["passes"].append({"pass": pass_name, "files": stem, "rewrites": len(new_r),
                            "near_misses": len(new_m), "errors": len(new_e)})
        (gdir / "report.txt").write_text(report.summary() + "\n")
        self.save()
        self.progress(f"compiling graph {g['graph']}: pass {pass_name} done "
                      f"({len(new_r)} rewrite(s), {len(new_m)} near-miss(es))")

    def save(self) -> None:
        out = []
        for g in self.graphs:
            rep = dataclasses.asdict(g["_report"])
            out.append({"graph": g["graph"], "compile_id": g["compile_id"],
                        "passes": g["passes"], "fingerprint": g["_report"].fingerprint(),
                        "rewrites": rep["rewrites"], "near_misses": rep["near_misses"],
                        "errors": rep["errors"]})
        tmp = self.root / "report.json.tmp"
        tmp.write_text(json.dumps(out, indent=1, default=str))
        tmp.replace(self.root / "report.json")


def rank_main(spec_json: str) -> None:
    """Entry point of one rank process (started by run_diff)."""
    spec = json.loads(spec_json)
    rank, root = int(os.environ["RANK"]), Path(spec["out"]) / f"rank{os.environ['RANK']}"
    root.mkdir(parents=True, exist_ok=True)
    progress_file = open(root / "progress.log", "a", buffering=1)
    t0 = time.monotonic()

    def progress(stage: str) -> None:
        progress_file.write(f"{time.monotonic() - t0:8.1f}s {stage}\n")

    progress("importing torch and commfold")
    import depyf
    import torch
    import torch.distributed as dist
    from torch._dynamo.callback import callback_handler
    from torch._inductor import config as inductor_config

    import commfold
    from commfold.manager import CommfoldPass, observing

    config = commfold.Config(passes=tuple(spec["passes"]))
    inductor_config.post_grad_custom_post_pass = CommfoldPass(config)
    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    recorder = Recorder(root, progress)
    callback_handler.register_start_callback(
        lambda args: progress(f"compiling (dynamo frame {args.compile_id})"))
    callback_handler.register_end_callback(lambda args: progress("running target"))

    target = Target(**spec["target"])
    with depyf.prepare_debug(str(root / "depyf")), observing(recorder, config.passes):
        if target.script:
            progress("running target")
            sys.argv = [target.script]
            sys.path.insert(0, str(Path(target.script).parent))
            import runpy

            runpy.run_path(target.script, run_name="__main__")
        else:
            progress("initializing gloo process group")
            dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
            sys.path.insert(0, os.getcwd())
            import importlib

            fn = getattr(importlib.import_module(target.module), target.function)
            progress("running target")
            fn()
        progress("writing depyf dumps")
    recorder.save()
    if dist.is_initialized():
        dist.destroy_process_group()
    progress("done")


# --------------------------------------------------------------------- the parent
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
    from commfold.config import ALL_PASSES
    from commfold.testing import free_port

    target = Target.parse(target_text)
    if world_size < 1:
        raise DiffError("--world-size must be at least 1", EXIT_BAD_INPUT)
    passes = list(passes) if passes else list(ALL_PASSES)
    unknown = [p for p in passes if p not in ALL_PASSES]
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
            [sys.executable, "-c", "import sys; from commfold.diff import rank_main; "
                                   "rank_main(sys.argv[1])", spec],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        failed = _watch(procs, out_dir, timeout, echo)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
        for log in logs:
            log.close()
    if failed:
        raise DiffError(failed + f" (dumps so far kept in {out_dir})", EXIT_RANK_FAILED)
    graphs = [_load(out_dir / f"rank{r}" / "report.json") for r in range(world_size)]
    if not any(graphs):
        raise DiffError(f"{target} compiled nothing with Inductor: no torch.compile call ran "
                        "(or it used a non-Inductor backend), so there is nothing to diff",
                        EXIT_BAD_INPUT)
    text = summary(graphs, out_dir)
    (out_dir / "summary.txt").write_text(text + "\n")
    echo(text)
    return EXIT_OK


def _kill(p: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(p.pid, signal.SIGKILL)  # the rank and any compile workers it started
    except (ProcessLookupError, PermissionError):
        p.kill()
    p.wait(timeout=10)


def _watch(procs, out_dir: Path, timeout: float, echo) -> str | None:
    """Print each rank's stage as it changes; return None when all ranks exit 0,
    else a one-line cause (the others are killed: they may wait in a collective)."""
    t0, last, seen = time.monotonic(), {}, {}
    grace_until = None
    first_failure = None
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
            if code not in (None, 0) and first_failure is None:
                log = out_dir / f"rank{r}" / "log.txt"
                first_failure = f"rank {r} failed: {_cause(log)} (log: {log})"
                grace_until = time.monotonic() + 5.0
        if all(p.poll() == 0 for p in procs):
            return None
        if first_failure and (all(p.poll() is not None for p in procs)
                              or time.monotonic() > grace_until):
            return first_failure
        if now > timeout:
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            where = "; ".join(f"rank {r} in '{last.get(r)}'" for r in hung)
            return (f"rank(s) {hung} still running after {timeout:.0f}s (hung?): {where} "
                    f"(logs: {out_dir}/rank*/log.txt)")
        time.sleep(0.2)


def _load(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


# ---------------------------------------------------------------------- summary
def _fmt_comm(c: dict) -> str:
    from commfold.report import Comm

    return str(Comm(c["bytes"], c["calls"]))


def format_bytes(n) -> str:
    from commfold.report import format_bytes

    return format_bytes(n)


def summary(graphs_per_rank: list[list[dict]], out_dir: Path) -> str:
    """The table users read: rank 0's decisions, per graph, plus whether every rank
    decided the same (a mismatch would be a collective mismatch: a hang)."""
    graphs = graphs_per_rank[0]
    rows = [("graph", "pass", "pattern", "source", "comm/call before -> after", "extra mem")]
    misses, errors = [], []
    for g in graphs:
        for r in g["rewrites"]:
            rows.append((str(g["graph"]), r["pass_name"], r["pattern"], r["location"],
                         f"{_fmt_comm(r['comm_before'])} -> {_fmt_comm(r['comm_after'])}",
                         format_bytes(r["extra_memory_bytes"])))
        misses += [(g["graph"], m) for m in g["near_misses"]]
        errors += [(g["graph"], e) for e in g["errors"]]
    n_rewrites = len(rows) - 1
    lines = [f"commfold diff: {len(graphs)} graph(s) compiled, {n_rewrites} rewrite(s), "
             f"{len(misses)} near-miss(es), {len(errors)} pass error(s) (rank 0)"]
    if n_rewrites:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  " + " | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                  for row in rows]
    else:
        lines.append("  no rewrites")
    if misses:
        lines.append("near-misses:")
        lines += [f"  graph {g} [{m['pass_name']}/{m['pattern']}] at {m['location']}: {m['reason']}"
                  for g, m in misses]
    for g, e in errors:
        first = (e["error"].splitlines() or [""])[0][:200]
        lines.append(f"  ERROR graph {g} in {e['pass_name']}: {first} (graph left unchanged by it)")
    prints = [[g["fingerprint"] for g in gs] for gs in graphs_per_rank]
    if all(p == prints[0] for p in prints):
        lines.append(f"ranks: all {len(prints)} decided the same on every graph")
    else:
        bad = [r for r, p in enumerate(prints) if p != prints[0]]
        lines.append(f"WARNING: rank(s) {bad} decided differently from rank 0 "
                     "(a collective mismatch: report it as a commfold bug)")
    lines.append(f"dumps: {out_dir}/rank<r>/graph<g>/NN_<pass>.{{before.py,after.py,diff}}, "
                 f"rank<r>/depyf/ (decompiled dynamo code), rank<r>/log.txt")
    return "\n".join(lines)
