"""What the passes that pick over a rank's vocab shard instead of the gathered row
(local_argmax, local_topk, local_softmax_stats) share: which matched sites a local
pick can take (``qualified``, ``tanh_refusal``), how the shard is fed to the pick's
op (``shard_and_chain``), and the greedy pick's rewrite (``rewrite_pick``: local_argmax's
own, also used by local_softmax_stats for picks that share a row with statistics).

Not a pass (the registry, commfold.config.ALL_PASSES, names no module starting with
an underscore): a module of rewrite pieces, so it lives with the rewrites, and each of
those passes imports it instead of another pass.
"""
from __future__ import annotations

import operator

import torch

from commfold.context import PassContext
from commfold.fx.edit import erase_if_dead, insert_call, replace_items, replay
from commfold.fx.nodes import fake_tensor, is_call, nbytes, numel_times, tensor_val
from commfold.ops import chain_encoding
from commfold.patterns.common import aten
from commfold.patterns.gather import gather_candidates
from commfold.patterns.greedy import GreedyPick
from commfold.patterns.scan_chain import chain_steps
from commfold.report import Comm

# the greedy pick's pattern, under which rewrite_pick records it
PICK_PATTERN = "all_gather->argmax"


def qualified(ctx: PassContext, pattern: str, matcher, reader, dtypes, dtype_reason: str):
    """The matches of `matcher` (a recognizer after a vocab gather) that a local pick
    can take: logits of a dtype in `dtypes`, ops it can reproduce (tanh_refusal); the
    others recorded as near-misses at reader(match)."""
    for m in ctx.matches(pattern, gather_candidates(ctx.graph), matcher):
        node = reader(m)
        why = dtype_reason if fake_tensor(node.args[0]).dtype not in dtypes else \
            tanh_refusal(m.gather.shard, m.elementwise)
        if why:
            ctx.skipped(pattern, node, why)
        else:
            yield m


def rewrite_pick(ctx: PassContext, m: GreedyPick, before: Comm | None = None) -> None:
    """Replace m's pick by commfold::local_argmax on the shard (local_argmax's rewrite;
    the softmax-statistics pass passes `before` so the removed gather is counted once)."""
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
    ctx.rewrote(PICK_PATTERN, m.pick, before, Comm(pair_bytes, 1),
                detail=f"{m.kind}, world {m.gather.world_size}, "
                       f"{'no padding' if m.valid_vocab is None else 'padding sliced off'}")


def tanh_refusal(shard, ops) -> str | None:
    """Why a pick over a CPU shard cannot take `ops` (a tanh among them), or None.
    Inductor's CPU code computes tanh two ways, Sleef's vectorized tanh or libm's
    tanhf, which differ in the last bits (docs/GUARANTEES.md), and chooses by how it
    tiles the kernel that reads the gathered row; the values a local kernel computes
    on the shard match one of them, not necessarily the program's."""
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
