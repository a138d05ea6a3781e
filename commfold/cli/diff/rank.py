"""Inside one rank of `commfold diff`: set commfold as Inductor's post-grad pass,
observe every pass, write each pass's before/after/diff at once (kept if the rank
later fails), and log the stages the parent's watchdog prints."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from commfold.cli.diff.render import render, unified
from commfold.cli.diff.target import Target


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


@contextmanager
def depyf_dumps(where: Path, progress):
    """depyf's decompiled Dynamo code, written when the target is done. Writing it can
    fail where depyf does not know a torch's bytecode (torch 2.11: a code object it
    reads is None): the rank then says so in its progress (printed by the parent), its
    log and where/NOT_WRITTEN.txt, and the diff (every pass's graphs and report) is
    complete without it."""
    import depyf

    debug = depyf.prepare_debug(str(where))
    debug.__enter__()
    try:
        yield
    except BaseException:
        debug.__exit__(*sys.exc_info())
        raise
    try:
        debug.__exit__(None, None, None)
    except Exception as e:  # depyf's own dump; the diff's are already written
        import torch

        why = (f"depyf {getattr(depyf, '__version__', '?')} could not write its dumps on "
               f"torch {torch.__version__}: {type(e).__name__}: {e}")
        progress(why)
        print(f"commfold diff: {why}; every pass's graphs and the report are complete",
              file=sys.stderr, flush=True)
        where.mkdir(parents=True, exist_ok=True)
        (where / "NOT_WRITTEN.txt").write_text(why + "\n")


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
    with depyf_dumps(root / "depyf", progress), observing(recorder, config.passes):
        if target.script:
            progress("running target")
            sys.argv = [target.script]
            # modules beside the script and beside the current directory import (the
            # checkout's harness/ for `commfold diff examples/...` run from its root)
            sys.path[:0] = [str(Path(target.script).parent), os.getcwd()]
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
        # ranks leave together: one that finished first would otherwise close its
        # connections while a peer is still joining the group (gloo's connectFullMesh
        # then fails there: "Connection closed by peer"), as when the target is quick
        progress("waiting for the other ranks")
        dist.barrier()
        dist.destroy_process_group()
    progress("done")
