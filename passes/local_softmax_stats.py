"""local_softmax_stats: log_softmax at chosen tokens, logsumexp and softmax's top
probability over vocab-sharded logits without gathering the logits.

Uses: patterns.gather.VocabGather and patterns.softmax_stats.RowReads (every reader
of the gathered row is an amax -> shift -> exp -> sum structure, read only through
row statistics, gathers at chosen columns and max(dim=-1) of the softmax, or a greedy
pick).

Why it is safe:
- nothing row-sized escapes (the recognizer checks every consumer of every
  vocab-wide node), so the full row need not exist;
- the graph's row reductions amax and sum become commfold::softmax_stats's exact
  global max and its float64-combined sum (within rounding of the graph's own
  float32 sum: a different summation order, no other change);
- everything after the reductions is the graph's own ops: log, the where(|A| == inf)
  of logsumexp, and `(x[idx] - shift) - log(S)` for each chosen column (the graph's
  `gather(D - L)`, elementwise so bit-identical given x, shift and L);
- softmax's max is exp(max - shift) / S at the first maximum of the row, and index 0
  when that value is NaN (the whole softmax row is NaN then: +inf, NaN or all -inf).
  A column whose probability rounds equal to the top one is not a tie: commfold
  returns the first maximum of the logits (see docs/GUARANTEES.md);
- a greedy argmax of the same row (exactly widened at most) is the statistics' own
  first maximum: its logprob is (M - shift) - log(S), nothing gathered; any other
  greedy pick of the row gets commfold::local_argmax.

Writes: shard -> commfold::softmax_stats: this rank's max (and first-max index) and
float64 sum of exp over its valid columns in one read of the shard (the elementwise
ops as a chain the op applies on CPU, else replayed as graph ops), and one
collective of 2 + argmax + picks float64 values per row per rank.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import stable_topological_sort

from commfold.context import PassContext
from commfold.fx.nodes import arg, fake_tensor, is_call, nbytes, numel_times
from commfold.fx.edit import erase_if_dead, insert_call, replace_items
from commfold.patterns.common import FLOAT_DTYPES, aten
from commfold.patterns.gather import after_vocab_gather, gather_candidates
from commfold.patterns.greedy import GreedyPick, PickKind
from commfold.patterns.softmax_stats import (Greedy, RowReads, SoftmaxStats, exact_widening,
                                             match_row_reads)
from commfold.report import Comm

from ._local_pick import rewrite_pick, shard_and_chain, tanh_refusal

PATTERN = "all_gather->softmax_stats"


def run(ctx: PassContext) -> None:
    changed = False
    for reads in ctx.matches(PATTERN, gather_candidates(ctx.graph),
                           after_vocab_gather(match_row_reads)):
        bad = [s for s in reads.stats if fake_tensor(s.base).dtype not in FLOAT_DTYPES]
        if bad:
            ctx.skipped(PATTERN, bad[0].amax, "softmax over non-floating logits")
            continue
        why = next(filter(None, (tanh_refusal(reads.gather.shard, r.chain)
                                 for r in (*reads.stats, *reads.greedy))), None)
        if why:
            ctx.skipped(PATTERN, reads.stats[0].amax if reads.stats else reads.greedy[0].pick,
                        why)
            continue
        _rewrite(ctx, reads)
        changed = True
    if changed:  # the op sits before the amax; a chosen index may be computed later
        stable_topological_sort(ctx.graph)


def _rewrite(ctx: PassContext, m: RowReads) -> None:
    graph = ctx.graph
    before = Comm(nbytes(fake_tensor(m.gather.gathered)), 1)
    replayed: dict[fx.Node, fx.Node] = {}
    fused: set[fx.Node] = set()
    sent = 0
    for s in m.stats:
        argmax = _fusable_argmax(s, m.greedy, fused)
        if argmax is not None:
            fused.add(argmax.pick)
        sent += _rewrite_stats(graph, m, s, argmax, replayed)
    for gr in m.greedy:
        if gr.pick not in fused:  # its own (value, index) exchange
            keep = bool(arg(gr.pick, "keepdim"))
            kind: PickKind = "argmax" if gr.pick.target is aten.argmax.default else "max"
            rewrite_pick(ctx, GreedyPick(m.gather, m.valid_vocab, gr.chain, gr.pick, kind, keep),
                         before=Comm(0, 0))
    erase_if_dead(m.gather.gathered, also=m.gather.comm_nodes)
    rows = fake_tensor(m.stats[0].sum)
    # `sent` float64 values per row per rank
    after = Comm(numel_times(rows, 8 * sent * m.gather.world_size), len(m.stats))
    ctx.rewrote(PATTERN, m.stats[0].amax, before, after, detail=_detail(m, fused))


def _rewrite_stats(graph, m: RowReads, s: SoftmaxStats, argmax: Greedy | None,
                   replayed) -> int:
    """Rewrite one structure; returns float64 values sent per row per rank."""
    picks = [p for p in s.picks
             if not (argmax is not None and _is_index_of(p.args[2], argmax.pick))]
    with graph.inserting_before(s.amax):
        x, chain = shard_and_chain(graph, m.gather.shard, s.chain, replayed)
        index = None
        if picks:
            parts = [p.args[2] for p in picks]
            index = parts[0] if len(parts) == 1 else insert_call(
                graph, aten.cat.default, (parts, -1), like=picks[0])
        out = insert_call(graph, torch.ops.commfold.softmax_stats.default,
                          (x, index, m.valid_vocab, m.gather.comm, s.finite_shift is not None,
                           argmax is not None or bool(s.softmax_max), *chain), like=s.amax)
        big_m, big_s, first, picked = (
            insert_call(graph, operator.getitem, (out, i), like=s.amax) for i in range(4))
    s.amax.replace_all_uses_with(big_m)
    shift = s.finite_shift if s.finite_shift is not None else big_m
    with graph.inserting_before(s.sum):
        total = big_s if s.sum_keepdim else insert_call(
            graph, aten.squeeze.dim, (big_s, -1), like=s.sum)
    s.sum.replace_all_uses_with(total)
    offset = 0
    for p in s.picks:  # gather(D - L, -1, idx) == (x[idx] - shift) - L, elementwise
        with graph.inserting_before(p):
            if p in picks:  # the op's own (x[idx] - shift) - log(S)
                k = fake_tensor(p).shape[-1]
                new = picked if len(picks) == 1 else insert_call(
                    graph, aten.slice.Tensor, (picked, -1, offset, offset + k), like=p)
                offset += k
            else:  # the logprob of the row's own argmax: x[idx] is M; the graph's L
                new = insert_call(graph, aten.sub.Tensor, (
                    insert_call(graph, aten.sub.Tensor, (big_m, shift), like=p), s.log), like=p)
        p.replace_all_uses_with(new)
    for mx in s.softmax_max:
        _rewrite_softmax_max(graph, mx, big_m, shift, big_s, first, s)
    if argmax is not None:
        with graph.inserting_before(argmax.pick):
            idx = insert_call(graph, aten.unsqueeze.default, (first, -1), like=argmax.pick) \
                if arg(argmax.pick, "keepdim") else first
        argmax.pick.replace_all_uses_with(idx)
    # s.exp: the online form's exp of D may be left unread (no sum reads it), and would
    # keep D, and so the gathered row, alive
    for dead in (*s.picks, *s.softmax_max, argmax.pick if argmax else None, s.sum, s.exp,
                 s.amax):
        if dead is not None and not dead._erased:
            erase_if_dead(dead, also=m.gather.comm_nodes)
    return 2 + (argmax is not None or bool(s.softmax_max)) + sum(
        fake_tensor(p).shape[-1] for p in picks)


def _rewrite_softmax_max(graph, mx, big_m, shift, big_s, first, s) -> None:
    """max(E / S, -1) (or argmax): value exp(M - shift) / S at the first maximum; index
    0 when the value is NaN (then the whole softmax row is NaN)."""
    with graph.inserting_before(mx):
        exp = insert_call(graph, aten.exp.default, (
            insert_call(graph, aten.sub.Tensor, (big_m, shift), like=mx),), like=mx)
        top = insert_call(graph, aten.div.Tensor, (exp, big_s), like=mx)
        nan = insert_call(graph, aten.isnan.default, (top,), like=mx)
        index = insert_call(graph, aten.where.ScalarSelf, (
            nan, 0, insert_call(graph, aten.unsqueeze.default, (first, -1), like=mx)), like=mx)
        if not arg(mx, "keepdim"):
            top = insert_call(graph, aten.squeeze.dim, (top, -1), like=mx)
            index = insert_call(graph, aten.squeeze.dim, (index, -1), like=mx)
    if mx.target is aten.argmax.default:
        mx.replace_all_uses_with(index)
    else:
        replace_items(mx, (top, index))


def _fusable_argmax(s: SoftmaxStats, greedy, taken) -> Greedy | None:
    """A greedy argmax of the same row as s, up to exact float widenings: the
    statistics' first maximum is its answer."""
    for gr in greedy:
        if gr.pick in taken or gr.pick.target is not aten.argmax.default:
            continue
        n = len(gr.chain)
        if s.chain[:n] == gr.chain and all(exact_widening(op) for op in s.chain[n:]):
            return gr
    return None


def _is_index_of(idx, pick: fx.Node) -> bool:
    """idx is argmax(..., keepdim=True) or argmax(...).unsqueeze(-1)."""
    if idx is pick:
        return bool(arg(pick, "keepdim"))
    if not is_call(idx, aten.unsqueeze.default) or idx.args[0] is not pick:
        return False
    return idx.args[1] in (-1, fake_tensor(pick).dim())


def _detail(m: RowReads, fused) -> str:
    kinds = []
    for s in m.stats:
        kinds.append("logsumexp" if s.finite_shift is not None else
                     "softmax max" if s.softmax_max and not s.picks else "log_softmax")
    extra = len(m.greedy) - len(fused)
    return (f"{', '.join(kinds)}, world {m.gather.world_size}"
            + (f", {len(fused)} greedy pick(s) fused" if fused else "")
            + (f", {extra} greedy pick(s) via local_argmax" if extra else ""))
