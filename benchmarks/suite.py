"""The performance suite: every performance figure in one run, commfold against plain
Inductor side by side, written as results.json, results.md and PNG plots.

    python -m benchmarks                      # full run (TP=2, and TP=4 where listed)
    python -m benchmarks --quick              # tiny sizes: proves the suite works
    python -m benchmarks --only local_argmax decode --out /tmp/bench
    python -m benchmarks --engine             # and the vLLM engine figures (needs vllm)

Figures run on gloo ranks of this machine (a RankPool per world size); each figure's
rank-side ``measure`` lives in its bench_*.py script (also runnable alone). Rank 0's
rows are reported. A figure that fails is recorded (error text) and the others run.
``--only`` keeps the other figures already in the output directory (each table says
when it ran).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import (bench_allreduce_rmsnorm, bench_compile_cost, bench_decode,
                        bench_local_argmax, bench_replicate, bench_sampling, bench_scan,
                        bench_vllm_lm_head)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    measure: object  # rank-side function of a bench_*.py
    full: tuple  # its arguments for the full run
    quick: tuple  # ... for --quick
    worlds: tuple = (2,)  # world sizes of the full run (--quick: 2 only)
    extra: dict = field(default_factory=dict)  # per-world argument overrides (full run)


V = 151936
FIGURES = {f.name: f for f in (
    Figure("local_argmax",
           "Greedy pick over vocab-sharded logits: all-gather + argmax vs local_argmax",
           bench_local_argmax.measure,
           full=([1, 8, 64, 256], [32000, V], 7), quick=([4], [1000], 5),
           worlds=(2, 4), extra={4: ([1, 64, 256], [V], 5)}),
    Figure("sampling", "Beyond greedy: greedy token + logprob, top-k, over vocab-sharded logits",
           bench_sampling.measure, full=([64], V, [1, 8, 50], 7), quick=([4], 1000, [1, 8], 5)),
    Figure("allreduce_rmsnorm", "all_reduce -> residual add -> RMSNorm: unfused vs fused (f32)",
           bench_allreduce_rmsnorm.measure,
           full=(["float32"], [1024, 4096], [1, 16, 256, 2048], 60),
           quick=(["float32"], [64], [4, 16], 5), worlds=(2, 4),
           extra={4: (["float32"], [1024, 4096], [1, 16, 256, 2048], 30)}),
    Figure("replicate", "Vocab-parallel embedding and LM head: sharded vs replicated (batch 1)",
           bench_replicate.measure,
           full=(V, (16, 32, 64, 256), 1, 7, ("embedding", "head")),
           quick=(1000, (16,), 1, 5, ("embedding", "head"))),
    Figure("decode", "End to end: greedy decode loop of a TP decoder, LM head in the graph",
           bench_decode.measure,
           full=(V, 64, 4, [1, 8], 16, 8, 5), quick=(32768, 64, 1, [2], 4, 2, 5)),
    Figure("compile_cost", "commfold's own time inside Inductor compiles",
           bench_compile_cost.measure, full=([8, 32, 128],), quick=([1],)),
    Figure("scan", "A rank's local scan vs one read of its shard (1 thread)",
           bench_scan.measure, full=([1, 8, 64], V // 2, ["float32", "bfloat16", "float16"], 25),
           quick=([4], 1000, ["float32"], 5), worlds=(1,)),
    # last of the TP=2 figures: it leaves vLLM's groups initialized in the pool's ranks
    Figure("vllm_lm_head", "Greedy pick over vLLM's real LM head (TP=2): vLLM's "
           "get_top_tokens vs full gather vs commfold",
           bench_vllm_lm_head.measure, full=(["shm", "gloo"], [1, 8, 64], [32000, V], 1024, 15),
           quick=(["gloo"], [2], [1000], 64, 5)),
)}


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="commfold vs plain Inductor, side by side on gloo ranks of this CPU: "
                    "writes results.json, results.md and PNG plots.",
        epilog="Figures: " + ", ".join(FIGURES) + ". The full run takes about 6-9 minutes "
               "on a quiet 2-core machine (the per-figure times are printed and kept in "
               "results.md); --quick about one.")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, not figures)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                   help=f"output directory (default: {DEFAULT_OUT})")
    p.add_argument("--only", nargs="+", choices=list(FIGURES), metavar="NAME",
                   help="run only these figures (" + ", ".join(FIGURES) + ")")
    p.add_argument("--timeout", type=float, default=1800, metavar="SECONDS",
                   help="give up on a figure after this long (default: 1800)")
    p.add_argument("--engine", action="store_true",
                   help="also rerun the vLLM engine figures into DIR/vllm_engine.json "
                        "(benchmarks.bench_vllm_engine with the README's settings, "
                        "--tokens 16 --repeats 2: about 11 minutes; needs vllm)")
    return p


# the engine figures the README quotes: bench_vllm_engine with these arguments
ENGINE_ARGS = ("--tokens", "16", "--repeats", "2")


def run_suite(names, quick: bool, timeout: float, log=print) -> dict:
    """Run the named figures; {"meta": ..., "figures": {name: {...}}}."""
    import torch

    from commfold.distributed.ranks import RankError, RankPool

    import commfold

    results = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick, "torch": torch.__version__, "commfold": commfold.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "machine": platform.machine(), "backend": "gloo", "rank_reported": 0},
        "figures": {}}
    t_suite = time.perf_counter()
    worlds = sorted({w for n in names for w in _worlds(FIGURES[n], quick)})
    for world in worlds:
        pool = None
        for name in names:
            fig = FIGURES[name]
            if world not in _worlds(fig, quick):
                continue
            args = fig.quick if quick else fig.extra.get(world, fig.full)
            entry = results["figures"].setdefault(
                name, {"title": fig.title, "world_sizes": [], "rows": [], "errors": [],
                       "seconds": 0.0, "date": results["meta"]["date"]})
            entry["world_sizes"].append(world)
            log(f"[bench] {name} TP={world} ...", flush=True)
            t0 = time.perf_counter()
            try:
                if pool is None or not pool.alive:
                    pool = RankPool(world, timeout=timeout)
                entry["rows"] += pool.run(fig.measure, *args, timeout=timeout)[0]
            except RankError as e:  # the pool is shut down: the next figure starts a new one
                entry["errors"].append(f"TP={world}: {e}")
                pool = None
            except Exception:
                entry["errors"].append(f"TP={world}: {traceback.format_exc()}")
            dt = time.perf_counter() - t0
            entry["seconds"] += dt
            log(f"[bench] {name} TP={world}: {dt:.0f} s"
                + (" (FAILED, see results)" if entry["errors"] else ""), flush=True)
        if pool is not None:
            pool.close()
    results["meta"]["seconds"] = time.perf_counter() - t_suite
    return results


def _worlds(fig: Figure, quick: bool) -> tuple:
    """The world sizes a figure runs at (--quick: its smallest only)."""
    return fig.worlds[:1] if quick else fig.worlds


def keep_previous(results: dict, out: Path) -> dict:
    """results plus the figures of the run already in out (same --quick) that this run
    did not redo, each with its own date: `--only` reruns a figure without dropping
    the others."""
    try:
        old = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return results
    if old.get("meta", {}).get("quick") != results["meta"]["quick"]:
        return results
    figures = {}
    for name in FIGURES:
        if name in results["figures"]:
            figures[name] = results["figures"][name]
        elif name in old.get("figures", {}):
            figures[name] = {"date": old["meta"].get("date"), **old["figures"][name]}
    return {**results, "figures": figures}


def write_results(results: dict, out: Path, log=print) -> dict:
    """results.json, results.md and (matplotlib permitting) PNG plots in out;
    {"json": path, "markdown": path, "plots": [paths], "plots_skipped": reason or None}."""
    from benchmarks.plots import plot_all
    from benchmarks.tables import markdown

    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    plots, skipped = plot_all(results, out)
    md_path.write_text(markdown(results, [p.name for p in plots], skipped))
    if skipped:
        log(f"[bench] plots skipped: {skipped}")
    return {"json": json_path, "markdown": md_path, "plots": plots, "plots_skipped": skipped}


def main(argv=None, prog: str = "python -m benchmarks") -> int:
    a = _parser(prog).parse_args(argv)
    names = list(a.only or FIGURES)
    results = run_suite(names, a.quick, a.timeout)
    failed = [n for n, f in results["figures"].items() if f["errors"]]
    if a.only:
        results = keep_previous(results, a.out)
    written = write_results(results, a.out)
    print(f"[bench] {results['meta']['seconds']:.0f} s; wrote {written['json']}, "
          f"{written['markdown']}" + "".join(f", {p}" for p in written["plots"]))
    if a.engine:
        from benchmarks import bench_vllm_engine

        print("[bench] vLLM engine figures ...", flush=True)
        if bench_vllm_engine.main([*ENGINE_ARGS, "--out", str(a.out)]):
            failed.append("vllm_engine")
    if failed:
        print(f"[bench] failed: {', '.join(failed)} (errors in results.json)", file=sys.stderr)
        return 1
    return 0
