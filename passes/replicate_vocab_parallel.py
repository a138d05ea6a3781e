"""replicate_vocab_parallel: compute small vocab-parallel embeddings and LM heads on a
replicated full weight, so steady-state steps run no collective for them.

Uses: patterns.vocab_parallel (VocabParallelEmbedding: served id ranges, shard, sum
all-reduce; VocabParallelLMHead: matmul with a weight shard, VocabGather, slice to the
valid vocab) and patterns.greedy (is the gathered row only argmax'ed?).

Decides, from shapes and the config only (so every rank decides the same):
- replicate when the FULL weight is at most ``Config.replicate_max_bytes`` (memory
  and the one-time build: a replicated embedding was faster at every size measured).
  The full size is world x rows-per-rank x row bytes, rows-per-rank being the shard's
  rows, or more when the served ids show a larger stride (a shorter last shard, as
  torch.chunk leaves, then gives the same figure on every rank);
- an LM head reads its full weight each step instead of its shard plus a gather of
  logits: faster for small heads, slower from a size that depends on the device. It
  is replicated up to commfold.cost's head limit (REPLICATE_HEAD: the limit measured
  for the weight's device, or Config.replicate_head_max_bytes when set);
- an LM head whose gathered logits only feed a greedy pick, when local_argmax is
  configured too, stays sharded for local_argmax above commfold.cost's
  REPLICATE_BEFORE_ARGMAX limit (a shard read + one pair gathered per row beats a
  full-weight read there).
The measurements behind the limits: docs/performance.md, "Replication limits".

Why it is safe: the replica is every rank's shard, bit for bit, in rank order, trimmed
to the ids the ranks serve / the sliced vocab (commfold.ops.replicate builds it once,
collectively, and rebuilds it when a shard changes: its docstring says how that stays
rank-consistent). Ids no rank serves get zero rows, as in the original sum.

Writes: ``commfold::replicated_embedding(ids, shard, ranges, W, comm)`` in place of the
all-reduced lookup; ``commfold::replicated_lm_head(hidden, shard, V, W, comm)`` (+ the
original reshape) in place of the gathered (and sliced) logits.
"""
from __future__ import annotations

import torch

from commfold import cost
from commfold.context import PassContext
from commfold.distributed.collectives import communicator
from commfold.fx.nodes import fake_tensor, nbytes, operands
from commfold.fx.edit import erase_if_dead, insert_call
from commfold.patterns.gather import gather_candidates, match_vocab_gather
from commfold.patterns.greedy import match_greedy
from commfold.patterns.vocab_parallel import (VocabParallelEmbedding, VocabParallelLMHead,
                                              embedding_candidates, match_embedding,
                                              match_lm_head)
from commfold.report import Comm

EMBEDDING = "vocab_parallel_embedding"
LM_HEAD = "vocab_parallel_lm_head"

def run(ctx: PassContext) -> None:
    for m in ctx.matches(EMBEDDING, embedding_candidates(ctx.graph), match_embedding):
        _embedding(ctx, m)
    for m in ctx.matches(LM_HEAD, gather_candidates(ctx.graph), _lm_head_match):
        _lm_head(ctx, m)


def _lm_head_match(coll):
    gather = match_vocab_gather(coll)
    return match_lm_head(gather) if gather else None


def _row_bytes(shard) -> int:
    v = fake_tensor(shard)
    return int(v.shape[1]) * v.element_size()


def _embedding(ctx: PassContext, m: VocabParallelEmbedding) -> None:
    world = communicator(m.comm).world_size()
    rows = int(fake_tensor(m.shard).shape[0])
    first = min(r.lo for r in m.ranges) if m.ranges else 0
    if world > 1:  # a shorter last shard: its first served id shows the full stride
        rows = max(rows, -(-first // (world - 1)))
    full = world * rows * _row_bytes(m.shard)
    if full > ctx.config.replicate_max_bytes:
        ctx.skipped(EMBEDDING, m.lookup, f"full weight {full} B > replicate_max_bytes "
                                         f"{ctx.config.replicate_max_bytes} B")
        return
    graph = ctx.graph
    flat = [v for r in m.ranges for v in (r.lo, r.hi, r.row_start)]
    with graph.inserting_before(m.output):
        new = insert_call(graph, torch.ops.commfold.replicated_embedding.default,
                          (m.ids, m.shard, flat, world, m.comm), like=m.lookup)
    before = Comm(nbytes(fake_tensor(m.output)), 1)
    m.output.replace_all_uses_with(new)
    erase_if_dead(m.output, also=m.comm_nodes)
    ctx.rewrote(EMBEDDING, new, before, Comm(0, 0), extra_memory_bytes=full,
                detail=f"world {world}, {len(m.ranges)} id range(s) per rank")


def _lm_head(ctx: PassContext, m: VocabParallelLMHead) -> None:
    g, graph = m.gather, ctx.graph
    vs = int(fake_tensor(m.shard).shape[0])
    cols = m.valid_vocab or g.world_size * vs
    full = cols * _row_bytes(m.shard)
    device = fake_tensor(m.shard).device.type
    why = cost.why_slower(cost.Site(cost.REPLICATE_HEAD, device, nbytes=full), ctx.config)
    if why:
        ctx.skipped(LM_HEAD, m.output, why)
        return
    pick = match_greedy(g)
    if pick and "local_argmax" in ctx.config.passes:
        why = cost.why_slower(cost.Site(cost.REPLICATE_BEFORE_ARGMAX, device, nbytes=full),
                              ctx.config)
        if why:
            ctx.skipped(LM_HEAD, pick.pick, why)
            return
    decision = "greedy pick follows: replicated (small head)" if pick else "logits used"
    with graph.inserting_before(m.output):
        logits = insert_call(graph, torch.ops.commfold.replicated_lm_head.default,
                             (m.hidden, m.shard, m.valid_vocab, g.world_size, g.comm),
                             like=m.output)
        if m.reshape is not None:
            shape = list(operands(m.reshape)[1])[:-1] + [cols]
            logits = insert_call(graph, torch.ops.aten.reshape.default, (logits, shape),
                                 like=m.output)
    before = Comm(nbytes(fake_tensor(g.gathered)), 1)
    m.output.replace_all_uses_with(logits)
    erase_if_dead(m.output, also=g.comm_nodes)
    ctx.rewrote(LM_HEAD, logits, before, Comm(0, 0), extra_memory_bytes=full,
                detail=f"world {g.world_size}, vocab {cols}; {decision}")
