"""A greedy pick that treats NaN logits as -inf, without the full-vocab gather: vLLM
0.34's draft pick (``greedy_argmax``: NaN as -inf on every path, ties to the first
index), where 0.32/0.33 pick with ``argmax`` (NaN wins).

The compiled pick is ``argmax(where(isnan(logits), -inf, logits))`` over the gathered
logits. Masking is elementwise, so masking each rank's shard before the gather gives
the same row; this post-grad pre-pass moves it there, and commfold's local_argmax
pass then sees its usual "gather -> slice -> argmax" and picks per rank (the (value,
index) pairs of NaN-free shards: the same first maximum as greedy_argmax's). Where
the mask is not read that way (no gather: one rank), the graph is left as it is.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from commfold.fx.edit import erase_if_dead, insert_call
from commfold.patterns.common import Miss, aten
from commfold.patterns.gather import gather_candidates, match_vocab_gather

_PICKS = (aten.argmax.default, aten.max.dim)


def _neg_inf(node) -> bool:
    if isinstance(node, (int, float)):
        return node == -math.inf
    if isinstance(node, fx.Node) and node.target in (aten.full.default,
                                                     aten.scalar_tensor.default):
        value = node.args[1] if node.target is aten.full.default else node.args[0]
        return isinstance(value, (int, float)) and value == -math.inf
    return False


def _nan_mask(x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(isnan, where) when x's readers are exactly ``where(isnan(x), -inf, x)``, read
    by an argmax / max(dim) only."""
    if len(x.users) != 2:
        return None
    isnan = next((u for u in x.users if u.target is aten.isnan.default), None)
    where = next((u for u in x.users if u.target is aten.where.self), None)
    if isnan is None or where is None or len(isnan.users) != 1:
        return None
    cond, fill, other = where.args
    if cond is not isnan or other is not x or not _neg_inf(fill):
        return None
    if not where.users or any(u.target not in _PICKS for u in where.users):
        return None
    return isnan, where


def mask_before_gather(graph: fx.Graph) -> int:
    """Move each NaN -> -inf mask between a vocab gather (and its slice) and a greedy
    pick onto the gathered shard; the number moved."""
    moved = 0
    for coll in gather_candidates(graph):
        g = match_vocab_gather(coll)
        if isinstance(g, Miss):
            continue
        x = g.gathered
        if len(x.users) == 1 and next(iter(x.users)).target is aten.slice.Tensor:
            x = next(iter(x.users))
        found = _nan_mask(x)
        if found is None:
            continue
        isnan, where = found
        shard = g.shard
        val = shard.meta["val"]
        with graph.inserting_after(shard):
            fill = insert_call(graph, aten.full.default, ([], -math.inf),
                               dict(dtype=val.dtype, layout=torch.strided,
                                    device=val.device, pin_memory=False))
        with graph.inserting_after(fill):
            nan = insert_call(graph, aten.isnan.default, (shard,))
        with graph.inserting_after(nan):
            masked = insert_call(graph, aten.where.self, (nan, fill, shard), like=where)
        g.collective.replace_input_with(shard, masked)
        where.replace_all_uses_with(x)
        erase_if_dead(where)
        moved += 1
    return moved


class MaskBeforeGather(CustomGraphPass):
    """Inductor's post-grad custom pre-pass: ``mask_before_gather``, then `then`."""

    def __init__(self, then=None):
        self.then = then

    def __call__(self, graph: fx.Graph) -> None:
        mask_before_gather(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        own = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
        then = self.then.uuid() if hasattr(self.then, "uuid") else None
        return own if self.then is None else (own, then)
