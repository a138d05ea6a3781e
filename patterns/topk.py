"""Top-k picks over gathered logits: optional slice to the valid vocab, optional
monotone elementwise ops (patterns.greedy.walk_to_reader), then either

- ``aten.topk(x, k[, dim=-1[, largest=True[, sorted]]])`` -> getitem 0 / 1, or
- ``aten.sort.default(x, -1, True)`` / ``aten.sort.stable(x, stable=.., descending=True)``
  -> getitem 0 / 1 -> ``aten.slice.Tensor(., vocab dim, 0, k)`` each (the first k),

with a static k (2 <= k <= MAX_K) over the vocab dim and nothing else reading the
row. A descending sort of a row of statically k <= MAX_K columns, used whole, is its
first k too (post-grad drops a [:k] slice of exactly k columns). topk(1) is a
greedy pick (patterns.greedy), not matched here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, final

import torch.fx as fx

from commfold.cost import LOCAL_TOPK_MAX_K
from commfold.fx.nodes import arg, fake_tensor, is_call, is_getitem, norm_dim

from .common import FLOAT_DTYPES, Miss, Recognized, aten, vocab_slice_end
from .gather import VocabGather
from .greedy import walk_to_reader

# the largest k taken: k int64 pairs per row per rank stay small (commfold.cost)
MAX_K = LOCAL_TOPK_MAX_K.value
_READERS = {aten.topk.default, aten.sort.default, aten.sort.stable}


@final
@dataclass(frozen=True)
class TopK:
    """The top k of a gathered row. `outputs` maps each node now holding the values
    (0) or indices (1) of the top k - topk's getitems, or the sort getitems' first-k
    slices - to which; `dead` are the nodes they replace, erased after."""

    gather: VocabGather
    valid_vocab: int | fx.Node | None
    elementwise: tuple[fx.Node, ...]
    reader: fx.Node  # the topk / sort node
    kind: Literal["topk", "sort"]
    k: int
    outputs: tuple[tuple[fx.Node, int], ...]


def match_topk(g: VocabGather) -> Recognized[TopK]:
    """The top-k pick reading g, a Miss saying why g's reader is not one, or None
    when no topk/sort reads g (or a topk(1): the greedy pass's)."""
    walk = walk_to_reader(g, _READERS)
    if not walk:
        return walk
    node = walk.reader
    rank = fake_tensor(g.shard).dim()
    dtype = fake_tensor(node.args[0]).dtype
    if dtype not in FLOAT_DTYPES:
        return Miss(f"top-k over {dtype} logits (floating point only)", node)
    if node.target is aten.topk.default:
        m = _match_topk(node, rank)
    else:
        m = _match_sort(node, rank)
    if not isinstance(m, tuple):
        return m
    kind, k, outputs = m
    return TopK(g, walk.valid_vocab, walk.elementwise, node, kind, k, outputs)


def _check_k(k, node) -> Miss | None:
    if not isinstance(k, int) or isinstance(k, bool):
        return Miss("top-k with a k not known at compile time", node)
    if k > MAX_K:
        return Miss(f"top-k with k > {MAX_K} (the gathered pairs would not be small)", node)
    return None


def _match_topk(node, rank):
    k = node.args[1]
    if k == 1:
        return None  # a greedy pick: local_argmax's
    miss = _check_k(k, node)
    if miss is not None:  # a Miss is falsy
        return miss
    if norm_dim(arg(node, "dim"), rank) != rank - 1:
        return Miss("topk over a dim other than vocab", node)
    if not arg(node, "largest"):
        return Miss("topk(largest=False) (smallest k: not supported)", node)
    if not all(is_getitem(u) for u in node.users):
        return Miss("topk() result used as a tuple", node)
    return "topk", k, tuple((u, u.args[1]) for u in node.users)


def _match_sort(node, rank):
    dim, descending = arg(node, "dim"), arg(node, "descending")
    if norm_dim(dim, rank) != rank - 1:
        return Miss("sort over a dim other than vocab", node)
    if not descending:
        return Miss("ascending sort (smallest first: not supported)", node)
    outputs, ks = [], set()
    for item in node.users:
        if not is_getitem(item):
            return Miss("sort() result used as a tuple", node)
        width = _static_width(item)
        if width is not None and width <= MAX_K and not all(
                _first_k(s, rank) for s in item.users):
            # a row of at most MAX_K columns sorted whole: its first `width` (a
            # slice [:k] of a row of exactly k columns is dropped as a no-op)
            ks.add(width)
            outputs.append((item, item.args[1]))
            continue
        for s in item.users:
            k = _first_k(s, rank)
            if k is None:
                return Miss("sorted logits used beyond a slice of the first k "
                            "(the full sorted row is needed)", node)
            ks.add(k)
            outputs.append((s, item.args[1]))
    if not outputs:
        return None
    if len(ks) > 1:
        return Miss("sort outputs sliced to different lengths", node)
    k = ks.pop()
    miss = _check_k(k, node)
    if miss is not None:  # a Miss is falsy
        return miss
    if k < 2:
        return Miss("sort sliced to fewer than 2 entries", node)
    return "sort", k, tuple(outputs)


def _static_width(node) -> int | None:
    width = fake_tensor(node).shape[-1]
    return width if isinstance(width, int) else None


def _first_k(s, rank) -> int | None:
    """k when s is slice(., vocab dim, 0|None, k) and its result provably has k
    columns (so the row holds at least k: no clamping); None otherwise."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not is_call(s, aten.slice.Tensor):
        return None
    cut = vocab_slice_end(s, rank)
    end = cut[0] if cut else None
    if not isinstance(end, int) or isinstance(end, bool):
        return None
    return end if statically_known_true(fake_tensor(s).shape[-1] == end) else None
