"""A drafter-like model at TP=2 under commfold's replicate_vocab_parallel.

    python -m examples.drafter              # r = 64 and 256, V = 151936, 2 gloo ranks
    python -m examples.drafter --r 64 --steps 4 --max-bytes 268435456

The drafter is Markov-style: the next token depends on the current one only.
    h = tanh(mix(embed(tok)) + proj(ctx(tok)));  tok = argmax(head(h))
- embed: vocab-parallel embedding V x r: replicated at r=64 (37.1 MiB, f32), under
  the default replicate_max_bytes (64 MiB);
- ctx: a vocab-parallel embedding V x 128 (74.2 MiB), above the threshold: it must
  stay sharded (its all-reduce stays);
- head: vocab-parallel LM head r x V (the logits all-gathered on the vocab dim, then
  argmax). A greedy pick after a head competes with local_argmax: by the measured rule
  (commfold.cost, REPLICATE_BEFORE_ARGMAX) a head this size is
  left to local_argmax, which the report records (without local_argmax it would stay
  sharded too: over the CPU's head limit, replicate_head_max_bytes).

Greedy drafting runs the same steps under the sharded original (the program compiled
with no commfold pass) and under commfold; the tokens must be identical. Prints each
rank-0 report, the collectives of one steady-state step, the replica memory per rank
and the step times.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

import commfold
from commfold.ops import replicate
from commfold.distributed.ranks import run_on_ranks
from commfold.distributed.comm_log import record_collectives

VOCAB = 151936
CTX_DIM = 128


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of a V x dim table on this rank; ids elsewhere give zeros,
    the sum all-reduce completes the lookup."""

    def __init__(self, vocab: int, dim: int, seed: int):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        vs = -(-vocab // world)
        self.start, self.end = min(rank * vs, vocab), min((rank + 1) * vs, vocab)
        g = torch.Generator().manual_seed(seed)  # the same full table on every rank
        full = torch.randn(vocab, dim, generator=g)
        self.weight = nn.Parameter(full[self.start:self.end].clone(), requires_grad=False)

    def forward(self, ids):
        mask = (ids < self.start) | (ids >= self.end)
        rows = F.embedding((ids - self.start).masked_fill(mask, 0), self.weight)
        return funcol.all_reduce(rows.masked_fill(mask.unsqueeze(-1), 0.0), "sum",
                                 dist.group.WORLD)


class VocabParallelLMHead(nn.Module):
    """A [Vs, dim] shard of the V x dim head (the last shard zero-padded); logits are
    all-gathered on the vocab dim and sliced to V."""

    def __init__(self, dim: int, vocab: int, seed: int):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        vs, self.vocab = -(-vocab // world), vocab
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(vocab, dim, generator=g) / dim ** 0.5
        shard = torch.zeros(vs, dim)
        part = full[rank * vs:(rank + 1) * vs]
        shard[:part.shape[0]] = part
        self.weight = nn.Parameter(shard, requires_grad=False)

    def forward(self, h):
        logits = h @ self.weight.t()
        world, rows = dist.get_world_size(), logits.shape[0]
        out = torch.empty((world * rows, logits.shape[1]), dtype=logits.dtype)
        dist.all_gather_into_tensor(out, logits)
        return out.view(world, rows, -1).permute(1, 0, 2).reshape(rows, -1)[:, :self.vocab]


class Drafter(nn.Module):
    def __init__(self, r: int, vocab: int = VOCAB):
        super().__init__()
        self.embed = VocabParallelEmbedding(vocab, r, seed=1)
        self.ctx = VocabParallelEmbedding(vocab, CTX_DIM, seed=2)
        torch.manual_seed(3)
        self.mix = nn.Linear(r, r)
        self.proj = nn.Linear(CTX_DIM, r)
        self.head = VocabParallelLMHead(r, vocab, seed=4)

    def forward(self, tok):
        h = torch.tanh(self.mix(self.embed(tok)) + self.proj(self.ctx(tok)))
        return self.head(h).argmax(-1)


def draft(step, tok, steps):
    out = []
    for _ in range(steps):
        tok = step(tok)
        out.append(tok)
    return torch.stack(out, -1)


def timed(step, tok, iters):
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        step(tok)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank_main(rs, steps, batch, max_bytes, passes, iters):
    results = []
    for r in rs:
        torch._dynamo.reset()
        with torch.no_grad():
            model = Drafter(r).eval()
            start = torch.arange(batch) * 9973 % VOCAB  # the same prompts on every rank
            original = torch.compile(model, backend=commfold.backend(passes=()))
            commfold.clear_reports()
            folded = torch.compile(model, backend=commfold.backend(
                passes=passes, replicate_max_bytes=max_bytes))
            want = draft(original, start, steps)
            got = draft(folded, start, steps)
            report = commfold.last_report()
            logs = {}
            for name, fn in (("original", original), ("commfold", folded)):
                fn(start)
                with record_collectives() as log:
                    fn(start)
                logs[name] = log
            t = {name: timed(fn, start, iters) for name, fn in (("original", original),
                                                                 ("commfold", folded))}
        results.append(dict(
            r=r, identical=torch.equal(want, got), tokens=got[0].tolist(),
            summary=report.summary(), fingerprint=report.fingerprint(),
            extra_reported=sum(x.extra_memory_bytes for x in report.rewrites),
            pass_ms={k: round(v * 1e3, 1) for k, v in report.pass_seconds.items()},
            extra_held=replicate.cached_bytes(),
            calls={k: [f"{e.name}{list(e.shapes)}" for e in v.events] for k, v in logs.items()},
            ms={k: v * 1e3 for k, v in t.items()}))
        replicate.invalidate_replicas()
    return results


def main():
    ap = argparse.ArgumentParser(description="drafter-like model under replicate_vocab_parallel")
    ap.add_argument("--r", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=8, help="tokens drafted per prompt")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10, help="timed steps")
    ap.add_argument("--max-bytes", type=int, default=commfold.Config().replicate_max_bytes)
    ap.add_argument("--passes", nargs="+", default=list(commfold.ALL_PASSES))
    a = ap.parse_args()
    per_rank = run_on_ranks(rank_main, 2, a.r, a.steps, a.batch, a.max_bytes,
                            tuple(a.passes), a.iters, timeout=1800)
    ok = True
    for i, res in enumerate(per_rank[0]):
        same_fp = len({p[i]["fingerprint"] for p in per_rank}) == 1
        ok &= res["identical"] and all(p[i]["identical"] for p in per_rank) and same_fp
        print(f"\n=== r = {res['r']}: V x r = {VOCAB * res['r'] * 4 / 2**20:.1f} MiB, "
              f"ctx V x {CTX_DIM} = {VOCAB * CTX_DIM * 4 / 2**20:.1f} MiB (f32), "
              f"replicate_max_bytes = {a.max_bytes / 2**20:.1f} MiB, TP=2")
        print(res["summary"])
        print(f"tokens identical to the sharded original: {res['identical']} "
              f"(first prompt drafted {res['tokens']}); same decisions on both ranks: {same_fp}")
        print(f"extra memory per rank: {res['extra_reported'] / 2**20:.1f} MiB reported, "
              f"{res['extra_held'] / 2**20:.1f} MiB held by replicas")
        print(f"compile-time pass cost (ms): {res['pass_ms']}")
        for name, calls in res["calls"].items():
            print(f"collectives in one steady-state step, {name:8}: {len(calls)} {calls}")
        ms = res["ms"]
        print(f"step time (median of {a.iters}, rank 0): original {ms['original']:.2f} ms, "
              f"commfold {ms['commfold']:.2f} ms ({ms['original'] / ms['commfold']:.2f}x)")
    print("\nOK" if ok else "\nMISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
