"""Step time of vocab-parallel layers, sharded vs replicated (replicate_vocab_parallel),
at TP=2 on this machine's CPU (gloo), side by side in one run.

    python -m benchmarks.bench_replicate                 # V=151936, r in {64, 256}
    python -m benchmarks.bench_replicate --vocab 32000 --iters 20 --batch 1

Rows (rank 0's median per step over interleaved iterations; ratio = sharded / other):
- embedding:    masked lookup + all-reduce   vs  replicated lookup (no collective)
- head:         matmul + all-gather of logits vs replicated matmul (no collective)
- head+argmax:  matmul + all-gather + argmax  vs  local_argmax (shard argmax + pair
                gather)  vs  replicated matmul + argmax: the measurement behind
                commfold.cost's REPLICATE_BEFORE_ARGMAX limit.
build ms: the one-time (and after-reload) cost of assembling the full weight.
Every variant is the same program compiled with a different commfold config. The
replicated form's lower bound is no collective at all per step. ``measure`` is the
rank-side function the suite (``python -m benchmarks``) runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import commfold
from commfold.ops import replicate
from commfold.distributed.ranks import run_on_ranks
from harness.bench import comm_of_variants, time_side_by_side

BIG = 1 << 40  # the replicate limits for the benchmark: replicate whatever is measured
LAYERS = ("embedding", "head", "head+argmax")


def embedding_program(start, end):
    def emb(ids, w):
        mask = (ids < start) | (ids >= end)
        e = F.embedding((ids - start).masked_fill(mask, 0), w).masked_fill(mask.unsqueeze(-1), 0.0)
        return funcol.all_reduce(e, "sum", dist.group.WORLD)
    return emb


def head_program(vocab, argmax):
    def head(h, w):  # in-place all-gather + movedim (funcol's own mis-views 1-row logits)
        logits = h @ w.t()
        world, rows = dist.get_world_size(), logits.shape[0]
        out = torch.empty((world * rows, logits.shape[1]), dtype=logits.dtype)
        dist.all_gather_into_tensor(out, logits)
        full = out.view(world, rows, -1).permute(1, 0, 2).reshape(rows, -1)[:, :vocab]
        return full.argmax(-1) if argmax else full
    return head


def _compile(fn, passes):
    limits = dict(replicate_max_bytes=BIG, replicate_head_max_bytes=BIG)
    return torch.compile(fn, backend=commfold.backend(passes=passes, **limits))


def _time(variants: dict, args, iters: int) -> dict:
    """Median step time of each variant, side by side, plus the one-time cost of
    assembling the replicated weight (a collective), as "build"; then each variant's
    steady-state communication per step."""
    out = time_side_by_side(variants, args, iters)
    rebuilds = []
    for _ in range(3):
        replicate.invalidate_replicas()
        dist.barrier()
        t0 = time.perf_counter()
        variants["replicated"](*args)
        rebuilds.append(time.perf_counter() - t0 - out["replicated"])
    out["build"] = statistics.median(rebuilds)
    out["comm"] = comm_of_variants(variants, args)
    out["comm"]["bound"] = {"bytes": 0, "calls": 0}
    return out


def measure(vocab: int, ranks: tuple, batch: int, iters: int, layers=LAYERS) -> list[dict]:
    """On every rank: one row per (layer, r) with median seconds per step of each
    variant (``<variant>_s``), the build time and communication per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    vs = -(-vocab // world)
    start, end = min(rank * vs, vocab), min((rank + 1) * vs, vocab)
    rows = []
    for r in ranks:
        torch._dynamo.reset()
        g = torch.Generator().manual_seed(0)
        emb_w = torch.randn(end - start, r, generator=g)
        head_w = torch.randn(vs, r, generator=g) / r ** 0.5
        ids = torch.randint(0, vocab, (batch,), generator=g)
        h = torch.randn(batch, r, generator=g)
        cases = {
            "embedding": (embedding_program(start, end), (ids, emb_w), ()),
            "head": (head_program(vocab, argmax=False), (h, head_w), ()),
            "head+argmax": (head_program(vocab, argmax=True), (h, head_w), ("local_argmax",)),
        }
        for layer in (x for x in LAYERS if x in layers):
            fn, args, others = cases[layer]
            variants = {"sharded": _compile(fn, ()),
                        **{p: _compile(fn, (p,)) for p in others},
                        "replicated": _compile(fn, ("replicate_vocab_parallel",))}
            t = _time(variants, args, iters)
            comm = t.pop("comm")
            rows.append({"baseline": "sharded", "rewritten": "replicated", "world": world,
                         "layer": layer, "V": vocab, "r": r, "batch": batch,
                         "full_mib": vocab * r * 4 / 2 ** 20,
                         **{f"{k}_s": v for k, v in t.items()}, "comm": comm})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--r", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=LAYERS)
    a = ap.parse_args(argv)
    rows = run_on_ranks(measure, 2, a.vocab, tuple(a.r), a.batch, a.iters, tuple(a.layers),
                        timeout=1800)[0]
    print(f"TP=2, gloo, CPU, batch {a.batch}, f32, median of {a.iters} interleaved steps (rank 0)")
    print(f"{'layer':28} {'full MiB':>8} {'sharded ms':>11} {'local_argmax ms':>16} "
          f"{'replicated ms':>14} {'sharded/replicated':>19} {'build ms':>9}")
    for t in rows:
        name = f"{t['layer']} {t['V']}x{t['r']}" if t["layer"] == "embedding" \
            else f"{t['layer']} {t['r']}x{t['V']}"
        la = f"{t['local_argmax_s'] * 1e3:16.3f}" if "local_argmax_s" in t else " " * 16
        print(f"{name:28} {t['full_mib']:8.1f} {t['sharded_s'] * 1e3:11.3f} {la} "
              f"{t['replicated_s'] * 1e3:14.3f} {t['sharded_s'] / t['replicated_s']:18.2f}x "
              f"{t['build_s'] * 1e3:9.1f}")


if __name__ == "__main__":
    main()
