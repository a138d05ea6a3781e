"""Greedy token selection over vocab-sharded logits on this CPU (gloo): plain
Inductor (all-gather of the logits + argmax) vs commfold (local argmax + a gather of
one (value, index) pair per row per rank), side by side in one run.

    python -m benchmarks.bench_local_argmax                  # B in {1, 64}, V=151936
    python -m benchmarks.bench_local_argmax --batch 1 8 64 256 --vocab 32000 151936

Prints rank 0's median time per call, the ratio plain / commfold (>1: faster) and the
bytes each rank put into collectives per call (lower bound after the rewrite: one
int64 pair, 16 B, per row). ``measure`` is the rank-side function the suite
(``python -m benchmarks``) runs.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from commfold.distributed.ranks import run_on_ranks
from harness.bench import comm_of_variants, floor_table, read_and_gather, \
    time_side_by_side

PAIR_BYTES = 16  # one (value bits, index) int64 pair per row


def greedy(shard, vocab):
    world, rows = dist.get_world_size(), shard.shape[0]
    out = torch.empty((world * rows, shard.shape[1]), dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard)  # in-place spelling: also valid for 1 row
    full = out.view(world, rows, -1).permute(1, 0, 2).reshape(rows, -1)
    return full[:, :vocab].argmax(-1)


def measure(batches, vocabs, iters) -> list[dict]:
    """On every rank: one row per (B, V) with median seconds per call of each variant,
    whether both picked the same tokens, and communication per call vs the bound."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for vocab in vocabs:
        vs = -(-vocab // world)
        for b in batches:
            torch._dynamo.reset()
            shard = torch.randn(b, vs, generator=torch.Generator().manual_seed(rank))
            fn = lambda s: greedy(s, vocab)  # noqa: E731, B023 (compiled and run in this iteration)
            variants = {"inductor": torch.compile(fn, backend="inductor"),
                        "commfold": torch.compile(fn, backend="commfold")}
            same = torch.equal(variants["inductor"](shard), variants["commfold"](shard))
            t = time_side_by_side(variants | {"floor": read_and_gather(shard, PAIR_BYTES)},
                                  (shard,), iters)
            comm = comm_of_variants(variants, (shard,))
            comm["bound"] = {"bytes": b * PAIR_BYTES, "calls": 1}
            rows.append({"baseline": "inductor", "rewritten": "commfold",
                         "world": world, "B": b, "V": vocab, "inductor_s": t["inductor"],
                         "commfold_s": t["commfold"], "floor_s": t["floor"], "same": same,
                         "comm": comm})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--vocab", type=int, nargs="+", default=[151936])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--world-size", type=int, default=2)
    a = p.parse_args(argv)
    rows = run_on_ranks(measure, a.world_size, a.batch, a.vocab, a.iters, timeout=3600)[0]
    print(f"local_argmax, TP={a.world_size}, CPU gloo, median of {a.iters} (rank 0)")
    print("floor: one read of the shard + the pair gather (the machine's limit)")
    print("\n".join(floor_table(rows, ["B", "V"], "same tokens")))


if __name__ == "__main__":
    main()
