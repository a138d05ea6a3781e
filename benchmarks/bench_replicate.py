"""Step time of vocab-parallel layers, sharded vs replicated (replicate_vocab_parallel),
at TP=2 on this machine's CPU (gloo), side by side in one run.

    python benchmarks/bench_replicate.py                 # V=151936, r in {64, 256}
    python benchmarks/bench_replicate.py --vocab 32000 --iters 20 --batch 1

Rows (rank 0's median per step over interleaved iterations; ratio = sharded / other):
- embedding:    masked lookup + all-reduce   vs  replicated lookup (no collective)
- head:         matmul + all-gather of logits vs replicated matmul (no collective)
- head+argmax:  matmul + all-gather + argmax  vs  local_argmax (shard argmax + pair
                gather)  vs  replicated matmul + argmax: the measurement behind
                ARGMAX_REPLICATE_MAX_BYTES in passes/replicate_vocab_parallel.py.
build ms: the one-time (and after-reload) cost of assembling the full weight.
Every variant is the same program compiled with a different commfold config.
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
from commfold.testing import run_on_ranks
from commfold.testing.bench import time_side_by_side

BIG = 1 << 40  # replicate_max_bytes for the benchmark: replicate whatever is measured


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
    return torch.compile(fn, backend=commfold.backend(passes=passes, replicate_max_bytes=BIG))


def _time(variants: dict, args, iters: int) -> dict:
    """Median step time of each variant, side by side, plus the one-time cost of
    assembling the replicated weight (a collective), as "build"."""
    out = time_side_by_side(variants, args, iters)
    rebuilds = []
    for _ in range(3):
        replicate.invalidate_replicas()
        dist.barrier()
        t0 = time.perf_counter()
        variants["replicated"](*args)
        rebuilds.append(time.perf_counter() - t0 - out["replicated"])
    out["build"] = statistics.median(rebuilds)
    return out


def bench(vocab: int, ranks: tuple, batch: int, iters: int, layers=("embedding", "head", "head+argmax")) -> list:
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
        mib = vocab * r * 4 / 2 ** 20
        emb = embedding_program(start, end)
        t = None if "embedding" not in layers else _time({"sharded": _compile(emb, ()),
                   "replicated": _compile(emb, ("replicate_vocab_parallel",))}, (ids, emb_w), iters)
        rows.append((f"embedding {vocab}x{r}", mib, t))
        head = head_program(vocab, argmax=False)
        t = None if "head" not in layers else _time({"sharded": _compile(head, ()),
                   "replicated": _compile(head, ("replicate_vocab_parallel",))}, (h, head_w), iters)
        rows.append((f"head {r}x{vocab}", mib, t))
        pick = head_program(vocab, argmax=True)
        t = None if "head+argmax" not in layers else _time({"sharded": _compile(pick, ()),
                   "local_argmax": _compile(pick, ("local_argmax",)),
                   "replicated": _compile(pick, ("replicate_vocab_parallel",))}, (h, head_w), iters)
        rows.append((f"head+argmax {r}x{vocab}", mib, t))
    return [row for row in rows if row[2] is not None]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--r", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--layers", nargs="+", default=["embedding", "head", "head+argmax"],
                    choices=["embedding", "head", "head+argmax"])
    a = ap.parse_args()
    rows = run_on_ranks(bench, 2, a.vocab, tuple(a.r), a.batch, a.iters, tuple(a.layers),
                        timeout=1800)[0]
    print(f"TP=2, gloo, CPU, batch {a.batch}, f32, median of {a.iters} interleaved steps (rank 0)")
    print(f"{'layer':28} {'full MiB':>8} {'sharded ms':>11} {'local_argmax ms':>16} "
          f"{'replicated ms':>14} {'sharded/replicated':>19} {'build ms':>9}")
    for name, mib, t in rows:
        la = f"{t['local_argmax'] * 1e3:16.3f}" if "local_argmax" in t else " " * 16
        print(f"{name:28} {mib:8.1f} {t['sharded'] * 1e3:11.3f} {la} "
              f"{t['replicated'] * 1e3:14.3f} {t['sharded'] / t['replicated']:18.2f}x "
              f"{t['build'] * 1e3:9.1f}")


if __name__ == "__main__":
    main()
