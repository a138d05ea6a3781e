"""local_topk: the k largest logits (values and token ids) over vocab-sharded logits
without gathering the logits - top-k sampling and top-k logprobs.

Uses: patterns.gather.VocabGather (the all-gather on the vocab dim, any spelling) and
patterns.topk.TopK (slice to the valid vocab, monotone elementwise ops, then topk(k)
or a descending sort sliced to its first k; static 2 <= k <= 64).

Why it is safe:
- nothing but the topk / the sort's first-k slices reads the gathered logits (the
  recognizer checks every node on the way has one consumer), so the full row need
  not exist;
- the elementwise ops are replayed on the shard, so each logit compared is bit-for-bit
  the value compared before (a tanh on CPU excepted: not taken, see _local_pick.tanh_refusal);
- shards are concatenated in rank order (checked), so a rank's column j is global
  column rank * Vs + j; commfold::local_topk ranks columns by unique (value, -index)
  keys: exact values, NaN largest, padding past the valid vocab masked;
- order: descending, equal values lowest index first (stable descending sort's
  order). torch.topk and an unstable sort leave the order among ties unspecified, so
  that is one of the orders the original program may produce.

Writes: shard -> replayed ops -> commfold::local_topk(., valid_vocab, comm, k) whose
one collective gathers k (key, value) int64 pairs per row per rank (on CPU the ops
go into the op as a chain: see _local_pick.shard_and_chain).
"""
from __future__ import annotations

import operator

import torch

from commfold.context import PassContext
from commfold.fx.nodes import fake_tensor, nbytes, numel_times
from commfold.fx.edit import erase_if_dead, insert_call
from commfold.ops.local_topk import SUPPORTED_DTYPES
from commfold.patterns.gather import after_vocab_gather
from commfold.patterns.topk import TopK, match_topk
from commfold.report import Comm

from ._local_pick import qualified, shard_and_chain

PATTERN = "all_gather->topk"


def run(ctx: PassContext) -> None:
    for m in qualified(ctx, PATTERN, after_vocab_gather(match_topk), lambda m: m.reader,
                       SUPPORTED_DTYPES,
                       "logits dtype not supported (float64: no room for an index in a "
                       "64-bit key)"):
        _rewrite(ctx, m)


def _rewrite(ctx: PassContext, m: TopK) -> None:
    graph = ctx.graph
    before = Comm(nbytes(fake_tensor(m.gather.gathered)), 1)
    with graph.inserting_before(m.reader):
        x, chain = shard_and_chain(graph, m.gather.shard, m.elementwise)
        top = insert_call(graph, torch.ops.commfold.local_topk.default,
                          (x, m.valid_vocab, m.gather.comm, m.k, *chain), like=m.reader)
        new = [insert_call(graph, operator.getitem, (top, i), like=m.reader) for i in (0, 1)]
    for old, which in m.outputs:
        old.replace_all_uses_with(new[which])
        erase_if_dead(old, also=m.gather.comm_nodes)  # transitively: up to the gather
    # k int64 (key, value) pairs per row per rank, as the collective outputs
    pairs = numel_times(fake_tensor(new[1]), 16 * m.gather.world_size)
    ctx.rewrote(PATTERN, m.reader, before, Comm(pairs, 1),
                detail=f"{m.kind} k={m.k}, world {m.gather.world_size}, "
                       f"{'no padding' if m.valid_vocab is None else 'padding sliced off'}")
