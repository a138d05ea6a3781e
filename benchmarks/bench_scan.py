"""A rank's local work against the machine's limit: commfold's one-pass scans of a
vocab shard (argmax, top-k, softmax statistics) against one read of the shard
(``x.sum()``) and against the best Inductor-compiled kernels of the same reduction,
one thread, side by side in one run.

    python -m benchmarks.bench_scan              # B 1/8/64 x 75968, f32, bf16, fp16
    python -m benchmarks.bench_scan --rows 1 64 --cols 75968 --dtypes float32

The shard [B, V/TP] is what each rank scans at B=64, V=151936, TP=2. Targets (issue
19): argmax <= 1.5x one read, top-8 <= 2x one read, softmax statistics <= 2x
Inductor's compiled logsumexp. ``measure`` is the function the suite runs (on one
rank of a pool of one).
"""
from __future__ import annotations

import argparse

import torch

from harness.bench import time_side_by_side


def measure(rows_list, cols: int, dtypes, iters: int) -> list[dict]:
    from commfold.ops import vocab_scan

    mod = vocab_scan.module()
    torch.set_num_threads(1)
    out = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for rows in rows_list:
            torch._dynamo.reset()
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(dt)
            read = lambda: x.sum()  # noqa: E731
            ind_argmax = torch.compile(lambda t: t.argmax(-1))
            ind_top8 = torch.compile(lambda t: torch.topk(t, 8, dim=-1))
            ind_lse = torch.compile(lambda t: torch.logsumexp(t.float(), -1))
            variants = {
                "read": read,
                "argmax": lambda: mod.argmax_rows(x, cols, None),
                "inductor_argmax": lambda: ind_argmax(x),
                "top8": lambda: mod.topk_rows(x, cols, 8, None),
                "top50": lambda: mod.topk_rows(x, cols, 50, None),
                "inductor_top8": lambda: ind_top8(x),
                "softmax_stats": lambda: mod.softmax_rows(x, cols, None),
                "inductor_logsumexp": lambda: ind_lse(x),
            }
            t = time_side_by_side(variants, (), iters)
            out.append({"dtype": dtype, "rows": rows, "cols": cols, "isa": mod.isa(),
                        **{f"{k}_s": v for k, v in t.items()}})
    return out


def table(rows) -> str:
    lines = ["| dtype | shard | one read (ms) | argmax | top-8 | top-50 | softmax stats | "
             "Inductor argmax | Inductor top-8 | Inductor logsumexp |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        read = r["read_s"]

        def x(k):
            return f"{r[k + '_s'] * 1e3:.3f} ms = {r[k + '_s'] / read:.2f}x"

        lines.append(f"| {r['dtype']} | [{r['rows']}, {r['cols']}] | {read * 1e3:.3f} | "
                     f"{x('argmax')} | {x('top8')} | {x('top50')} | {x('softmax_stats')} "
                     f"({r['softmax_stats_s'] / r['inductor_logsumexp_s']:.2f}x Inductor) | "
                     f"{x('inductor_argmax')} | {x('inductor_top8')} | "
                     f"{x('inductor_logsumexp')} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--cols", type=int, default=75968)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=25)
    a = p.parse_args(argv)
    rows = measure(a.rows, a.cols, a.dtypes, a.iters)
    print(f"per-rank scans vs one read of the shard, 1 thread, median of {a.iters} "
          f"({rows[0]['isa']})")
    print(table(rows))


if __name__ == "__main__":
    main()
