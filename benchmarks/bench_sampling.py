"""Beyond greedy on this CPU (gloo): the greedy token with its logprob, and top-k
(k in {1, 8, 50}) over vocab-sharded logits: plain Inductor (all-gather of the
logits) vs commfold (local_softmax_stats / local_topk / local_argmax: a few values
per row per rank), side by side in one run.

    python -m benchmarks.bench_sampling                      # B=64, V=151936, TP=2
    python -m benchmarks.bench_sampling --batch 1 64 --k 1 8 50

Prints rank 0's median time per call, the ratio plain / commfold (>1: faster),
whether results agree (tokens and indices exactly, logprobs within 1e-5) and the
bytes each rank put into collectives per call against the rewritten form's bound
(greedy+logprob: 3 float64 per row; top-k: k (key, value) int64 pairs per row).
``measure`` is the rank-side function the suite (``python -m benchmarks``) runs.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from commfold.distributed.ranks import run_on_ranks
from harness.bench import comm_of_variants, floor_table, read_and_gather, \
    time_side_by_side


def _gather(shard):
    world, rows = dist.get_world_size(), shard.shape[0]
    out = torch.empty((world * rows, shard.shape[1]), dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard)
    return out.view(world, rows, -1).permute(1, 0, 2).reshape(rows, -1)


def greedy_logprob(shard, vocab):
    """vLLM's greedy path with logprobs=1: the token and its logprob."""
    x = _gather(shard)[:, :vocab]
    tok = x.argmax(-1)
    return tok, torch.log_softmax(x.float(), -1).gather(-1, tok[:, None])


def top_k(shard, vocab, k):
    v, i = torch.topk(_gather(shard)[:, :vocab], k, dim=-1)
    return v, i


def _same(a, b) -> bool:
    for x, y in zip(a, b):
        if x.is_floating_point() and not torch.allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True):
            return False
        if not x.is_floating_point() and not torch.equal(x, y):
            return False
    return True


def measure(batches, vocab, ks, iters) -> list[dict]:
    """On every rank: one row per (case, B) with median seconds per call of each
    variant, agreement, and communication per call vs the bound."""
    rank, world = dist.get_rank(), dist.get_world_size()
    vs = -(-vocab // world)
    cases = [("greedy+logprob", None)] + [(f"top-{k}", k) for k in ks]
    rows = []
    for b in batches:
        shard = torch.randn(b, vs, generator=torch.Generator().manual_seed(rank))
        for label, k in cases:
            torch._dynamo.reset()
            fn = (lambda s: greedy_logprob(s, vocab)) if k is None else \
                (lambda s, k=k: top_k(s, vocab, k))
            variants = {"inductor": torch.compile(fn, backend="inductor"),
                        "commfold": torch.compile(fn, backend="commfold")}
            same = _same(variants["commfold"](shard), variants["inductor"](shard))
            per_row = 3 * 8 if k is None else (16 if k == 1 else 16 * k)
            t = time_side_by_side(variants | {"floor": read_and_gather(shard, per_row)},
                                  (shard,), iters)
            comm = comm_of_variants(variants, (shard,))
            comm["bound"] = {"bytes": b * per_row, "calls": 1}
            rows.append({"baseline": "inductor", "rewritten": "commfold", "world": world,
                         "case": label, "B": b, "V": vocab, "inductor_s": t["inductor"],
                         "commfold_s": t["commfold"], "floor_s": t["floor"], "same": same,
                         "comm": comm})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, nargs="+", default=[1, 8, 50])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--world-size", type=int, default=2)
    a = p.parse_args(argv)
    rows = run_on_ranks(measure, a.world_size, a.batch, a.vocab, a.k, a.iters, timeout=3600)[0]
    print(f"sampling reads, TP={a.world_size}, CPU gloo, median of {a.iters} (rank 0)")
    print("floor: one read of the shard + one gather of the bound's bytes (the machine's "
          "limit; the logprob's exp over every logit is compute on top)")
    print("\n".join(floor_table(rows, ["case", "B", "V"])))


if __name__ == "__main__":
    main()
