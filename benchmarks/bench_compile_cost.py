"""commfold's own cost inside an Inductor compile: time in commfold vs the whole
compile, per rewrite, and against graph size (8/32/128-layer TP decoders, TP=2).

    python benchmarks/bench_compile_cost.py                 # 8 and 32 layers
    python benchmarks/bench_compile_cost.py --layers 8 32 128

commfold's time is the whole post-grad hook (CommfoldPass.__call__: the restore
checkpoint, every pass, the lint after a rewrite, the report), timed from outside;
the per-pass figures are the report's. Targets (issue 7): at most 2% of compile time,
at most 1 ms per rewrite, near-linear in graph size. Reports rank 0's figures;
Inductor's caches are off; one untimed 1-layer compile first takes the process's
one-time costs (imports, first calls) out of the figures. ``measure`` is the rank-side function the suite runs.
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import torch

import commfold
from commfold.manager import CommfoldPass
from commfold.testing import run_on_ranks


@contextmanager
def _timed_hook(seen: list):
    """Append (seconds, graph nodes) of every CommfoldPass call while active."""
    original = CommfoldPass.__call__

    def timed(self, graph):
        nodes = len(graph.nodes)
        t0 = time.perf_counter()
        try:
            return original(self, graph)
        finally:
            seen.append((time.perf_counter() - t0, nodes))

    CommfoldPass.__call__ = timed
    try:
        yield
    finally:
        CommfoldPass.__call__ = original


def measure(layers_list) -> list[dict]:
    """On every rank: per layer count, the whole compile (+ first call) time, the time
    inside commfold, graph nodes, rewrites and per-pass seconds."""
    from torch._inductor import config as inductor_config

    from commfold.models import DecoderConfig, TPDecoder, sample_ids

    def compile_once(layers: int, seen: list) -> float:
        torch._dynamo.reset()
        cfg = DecoderConfig(vocab=4096, hidden=64, layers=layers, heads=2, ffn=128)
        model = TPDecoder(cfg)
        ids = sample_ids(cfg, 2, 4)
        commfold.clear_reports()
        with inductor_config.patch(fx_graph_cache=False), _timed_hook(seen):
            t0 = time.perf_counter()
            torch.compile(model, backend="commfold")(ids)
            return time.perf_counter() - t0

    compile_once(1, [])  # untimed: the process's one-time imports and first-call costs
    rows = []
    for layers in layers_list:
        seen: list = []
        total = compile_once(layers, seen)
        reps = commfold.reports()
        per_pass: dict = {}
        for r in reps:
            for k, v in r.pass_seconds.items():
                per_pass[k] = per_pass.get(k, 0.0) + v
        rows.append({"world": torch.distributed.get_world_size(), "layers": layers,
                     "compile_s": total, "commfold_s": sum(s for s, _ in seen),
                     "nodes": sum(n for _, n in seen),
                     "rewrites": sum(len(r.rewrites) for r in reps), "per_pass_s": per_pass})
    return rows


def table(rows) -> list[str]:
    """Markdown table lines for measure's rows."""
    out = ["| layers | graph nodes | compile (s) | commfold (ms) | share | rewrites | "
           "ms / rewrite | µs / node | per pass (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["per_pass_s"].items())
        out.append(f"| {r['layers']} | {r['nodes']} | {r['compile_s']:.1f} | "
                   f"{r['commfold_s'] * 1e3:.1f} | {100 * r['commfold_s'] / r['compile_s']:.2f}% | "
                   f"{r['rewrites']} | {r['commfold_s'] * 1e3 / max(1, r['rewrites']):.2f} | "
                   f"{r['commfold_s'] * 1e6 / max(1, r['nodes']):.1f} | {per} |")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    a = p.parse_args(argv)
    rows = run_on_ranks(measure, 2, a.layers, timeout=7200)[0]
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
