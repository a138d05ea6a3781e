"""local_argmax: greedy token selection over vocab-sharded logits without gathering
the logits.

Uses: patterns.gather.VocabGather (the all-gather on the vocab dim, any spelling) and
patterns.greedy.GreedyPick (slice to the valid vocab, monotone elementwise ops, argmax
/ max(dim=-1) / topk(1)).

Why it is safe:
- nothing but the pick reads the gathered logits (the recognizer checks every node
  on the way has one consumer), so the full row need not exist;
- the elementwise ops are replayed on the shard, so each logit the pick compares is
  bit-for-bit the value it compared before (no reliance on monotonicity for
  exactness; monotone-only is kept as the conservative rule);
- shards are concatenated in rank order (checked), so first-max-within-shard then
  first-max-over-ranks is torch's first-max rule; commfold::local_argmax keeps NaN
  as the maximum and masks padding columns past the valid vocab.
- topk(1) becomes first-max too: torch leaves topk's choice among ties unspecified
  (on CPU it varies with the row length); commfold picks the lowest index.
- not taken on CPU when a tanh is on the way (a soft cap): Inductor's CPU kernels
  compute tanh with Sleef where they vectorize and with libm's tanhf where they do
  not, which it decides by the gathered layout (an odd shard width, say); the two
  differ in the last bits for about a third of inputs, so no local kernel can know
  the unrewritten program's values (see ``tanh_refusal``). Triton's tanh is one
  function whatever the layout: on GPUs the ops are replayed and the rewrite stays.

Writes: shard -> replayed ops -> commfold::local_argmax(., valid_vocab, comm) whose
one collective gathers a (value, index) int64 pair per row per rank. On CPU the ops
(scale, temperature, soft-cap, casts) go into the op as a chain instead of being
replayed: it computes them as Inductor's CPU code would while it reads the shard.
"""
from __future__ import annotations

import operator

import torch

from commfold.context import PassContext
from commfold.fx.nodes import fake_tensor, is_call, nbytes, numel_times, tensor_val
from commfold.fx.edit import erase_if_dead, insert_call, replace_items, replay
from commfold.ops import chain_encoding
from commfold.ops.local_argmax import SUPPORTED_DTYPES
from commfold.patterns.common import aten
from commfold.patterns.gather import after_vocab_gather, gather_candidates
from commfold.patterns.greedy import GreedyPick, match_greedy
from commfold.patterns.scan_chain import chain_steps
from commfold.patterns.slice_writeback import fold_readbacks
from commfold.report import Comm

PATTERN = "all_gather->argmax"


def run(ctx: PassContext) -> None:
    for pick in qualified(ctx, PATTERN, after_vocab_gather(match_greedy), lambda m: m.pick,
                          SUPPORTED_DTYPES, "logits dtype not supported"):
        rewrite_pick(ctx, pick)


def qualified(ctx: PassContext, pattern: str, matcher, reader, dtypes, dtype_reason: str):
    """The matches of `matcher` (a recognizer after a vocab gather) that a local pick
    can take: logits of a dtype in `dtypes`, ops it can reproduce (tanh_refusal); the
    others recorded as near-misses at reader(match)."""
    fold_readbacks(ctx.graph)  # logits scaled in place: one reader again
    for m in ctx.matches(pattern, gather_candidates(ctx.graph), matcher):
        node = reader(m)
        why = dtype_reason if fake_tensor(node.args[0]).dtype not in dtypes else \
            tanh_refusal(m.gather.shard, m.elementwise)
        if why:
            ctx.skipped(pattern, node, why)
        else:
            yield m


def rewrite_pick(ctx: PassContext, m: GreedyPick, before: Comm | None = None) -> None:
    """Replace m's pick by commfold::local_argmax on the shard (also used by the
    softmax-statistics pass for picks that share a row with statistics; it passes
    `before` so the removed gather is counted once)."""
    graph = ctx.graph
    full = fake_tensor(m.gather.gathered)
    before = before or Comm(nbytes(full), 1)
    with graph.inserting_before(m.pick):
        x, chain = shard_and_chain(graph, m.gather.shard, m.elementwise)
        best = insert_call(graph, torch.ops.commfold.local_argmax.default,
                           (x, m.valid_vocab, m.gather.comm, m.keepdim, *chain), like=m.pick)
        value = insert_call(graph, operator.getitem, (best, 0), like=m.pick)
        index = insert_call(graph, operator.getitem, (best, 1), like=m.pick)
    if m.kind == "argmax":
        m.pick.replace_all_uses_with(index)
    else:
        replace_items(m.pick, (value, index))
    erase_if_dead(m.pick, also=m.gather.comm_nodes)
    # one int64 (value bits, index) pair per row per rank, as the collective outputs
    pair_bytes = numel_times(fake_tensor(index), 16 * m.gather.world_size)
    ctx.rewrote(PATTERN, m.pick, before, Comm(pair_bytes, 1),
                detail=f"{m.kind}, world {m.gather.world_size}, "
                       f"{'no padding' if m.valid_vocab is None else 'padding sliced off'}")


def tanh_refusal(shard, ops) -> str | None:
    """Why a pick over a CPU shard cannot take `ops` (a tanh among them), or None.
    Inductor's CPU code computes tanh two ways, Sleef's vectorized tanh or libm's
    tanhf (measured: 33% of soft-capped logits differ, by up to 2 ulp), and chooses by
    how it tiles the kernel that reads the gathered row; the values a local kernel
    computes on the shard match one of them, not necessarily the program's."""
    val = tensor_val(shard)
    if val is None or val.device.type != "cpu" or not any(
            is_call(n, aten.tanh.default) for n in ops):
        return None
    return ("tanh on the logits (a soft cap): Inductor's CPU code computes it with Sleef "
            "or libm by the gathered layout, which differ in the last bits, so a local "
            "pick cannot reproduce the program's values; the gather stays (on GPUs the "
            "pick is taken)")


def shard_and_chain(graph, shard, ops, memo=None) -> tuple:
    """(the op's input, (chain,) or ()): on CPU the shard itself, with the ops as a
    chain the op applies while it reads the shard (no scaled copy); otherwise the ops
    replayed on the shard as graph ops (same values per column) and no chain."""
    steps = chain_steps(ops)
    if steps == []:  # nothing but copies
        return shard, ()
    chain = chain_encoding.for_shard(fake_tensor(shard), steps)
    if chain is not None:
        return shard, (chain,)
    return replay(graph, shard, ops, memo), ()
