"""commfold's own cost inside an Inductor compile: time in the passes vs the whole
compile, per rewrite, and against graph size (8/32/128-layer TP decoders, TP=2).

    python benchmarks/bench_compile_cost.py                 # 8 and 32 layers
    python benchmarks/bench_compile_cost.py --layers 8 32 128

Targets (issue 7): at most 2% of compile time, at most 1 ms per rewrite, near-linear
in graph size. Reports rank 0's figures; Inductor's caches are off.
"""
from __future__ import annotations

import argparse
import time

import torch

import commfold
from commfold.testing import run_on_ranks


def measure(layers_list) -> list:
    from torch._inductor import config as inductor_config

    from commfold.models import DecoderConfig, TPDecoder, sample_ids

    rows = []
    for layers in layers_list:
        torch._dynamo.reset()
        cfg = DecoderConfig(vocab=4096, hidden=64, layers=layers, heads=2, ffn=128)
        model = TPDecoder(cfg)
        ids = sample_ids(cfg, 2, 4)
        commfold.clear_reports()
        with inductor_config.patch(fx_graph_cache=False):
            t0 = time.perf_counter()
            torch.compile(model, backend="commfold")(ids)
            total = time.perf_counter() - t0
        reps = commfold.reports()
        pass_s = sum(sum(r.pass_seconds.values()) for r in reps)
        rewrites = sum(len(r.rewrites) for r in reps)
        per_pass = {}
        for r in reps:
            for k, v in r.pass_seconds.items():
                per_pass[k] = per_pass.get(k, 0.0) + v
        rows.append({"layers": layers, "compile_s": total, "passes_s": pass_s,
                     "rewrites": rewrites, "per_pass_s": per_pass})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    a = p.parse_args(argv)
    rows = run_on_ranks(measure, 2, a.layers, timeout=7200)[0]
    print("| layers | compile (s) | commfold passes (ms) | share | rewrites | ms / rewrite | per pass (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        per = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["per_pass_s"].items())
        print(f"| {r['layers']} | {r['compile_s']:.1f} | {r['passes_s'] * 1e3:.1f} | "
              f"{100 * r['passes_s'] / r['compile_s']:.2f}% | {r['rewrites']} | "
              f"{r['passes_s'] * 1e3 / max(1, r['rewrites']):.2f} | {per} |")


if __name__ == "__main__":
    main()
