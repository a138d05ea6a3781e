"""Greedy picks over gathered logits: optional slice to the valid vocab, optional
monotone non-decreasing elementwise ops, then argmax / max(dim=-1) / topk(1) over the
vocab dim, with nothing else reading the gathered row."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, final

import torch
import torch.fx as fx

from commfold.fx.nodes import arg, fake_tensor, is_call, is_getitem, is_number, norm_dim, only_user

from .common import (FLOAT_DTYPES, Miss, Recognized, Verdict, aten, op_name, prims,
                     reader_within, vocab_slice_end)
from .gather import VocabGather

PickKind = Literal["argmax", "max", "topk"]



@final
@dataclass(frozen=True)
class GreedyPick:
    gather: VocabGather
    valid_vocab: int | fx.Node | None  # slice end (an int or a SymInt node); None: no slice
    elementwise: tuple[fx.Node, ...]  # monotone ops to replay on the shard, in order
    pick: fx.Node  # the argmax / max.dim / topk node
    kind: PickKind
    keepdim: bool


_PICKS: dict[object, PickKind] = {aten.argmax.default: "argmax", aten.max.dim: "max",
                                  aten.topk.default: "topk"}


def _positive_number(x) -> bool | None:
    """True/False for a Python number's sign; None when x is a tensor (sign unknown)."""
    if not is_number(x):
        return None
    return x > 0 and not math.isnan(x)


def monotone_step(node: fx.Node, x: fx.Node) -> str | None:
    """None when `node` (fed by x) is elementwise, non-decreasing in x and the same
    for every vocab column; otherwise why not."""
    t, a = node.target, node.args
    if t in (aten.mul.Tensor, aten.div.Tensor):
        other = a[1] if a[0] is x else a[0]
        if t is aten.div.Tensor and a[0] is not x:
            return "logits are a divisor (order-reversing)"
        sign = _positive_number(other)
        if sign is None:
            return "scaled by a tensor whose sign is unknown at compile time"
        return None if sign else "scaled by a non-positive number (order-reversing)"
    if t in (aten.add.Tensor, aten.sub.Tensor):
        other = a[1] if a[0] is x else a[0]
        if t is aten.sub.Tensor and a[0] is not x:
            return "logits are subtracted (order-reversing)"
        if len(a) > 2 or node.kwargs.get("alpha", 1) != 1:
            return "add/sub with alpha"
        return None if _positive_number(other) is not None else \
            "a tensor is added (may vary along the vocab dim)"
    if t in (aten.tanh.default,):
        return None
    if t in (prims.convert_element_type.default,) and a[1] in FLOAT_DTYPES:
        return None
    if t is aten._to_copy.default and node.kwargs.get("dtype") in FLOAT_DTYPES \
            and len(node.kwargs) <= 2:
        return None
    if t in (aten.neg.default,):
        return "negation (order-reversing)"
    name = getattr(t, "__name__", str(t))
    return f"{name} between the gather and the argmax is not a known monotone elementwise op"


@final
@dataclass(frozen=True)
class RowWalk:
    """The single-consumer path from a gathered row to the op that reads it: an
    optional slice to the valid vocab, then column-uniform elementwise ops."""

    valid_vocab: int | fx.Node | None
    elementwise: tuple[fx.Node, ...]
    reader: fx.Node


def walk_to_reader(g: VocabGather, readers) -> Recognized[RowWalk]:
    """Follow g's gathered row through a vocab slice and monotone elementwise ops to
    an op whose target is in `readers`; a Miss says why the path breaks (only when a
    reader is a few ops downstream), None when no reader reads g at all."""
    node, valid = g.gathered, None
    chain: list[fx.Node] = []
    rank = fake_tensor(g.shard).dim()
    while True:
        user = only_user(node)
        if user is None:
            return _near(node, "the gathered logits have other consumers", readers) \
                if node.users else None
        if user.target in readers:
            return RowWalk(valid, tuple(chain), user)
        if is_call(user, aten.slice.Tensor) and not chain and valid is None:
            cut = vocab_slice_end(user, rank)
            if not cut:
                return _near(user, cut.reason, readers)
            valid = cut[0]
            node = user
            continue
        if user.op == "call_function" and is_elementwise(user):
            why = monotone_step(user, node)
            if why is not None:
                return _near(user, why, readers)
            chain.append(user)
            node = user
            continue
        return _near(user, None, readers)


def match_greedy(g: VocabGather) -> Recognized[GreedyPick]:
    """The greedy pick reading g, a Miss saying why g's reader is not one, or None
    when nothing argmax-like reads g at all (not a near-miss: no record). topk with
    k > 1 is not a greedy pick: it is left to the top-k recognizer (None)."""
    walk = walk_to_reader(g, _PICKS)
    if not walk:
        return walk
    pick = walk.reader
    if pick.target is aten.topk.default and pick.args[1] != 1:
        return None
    return _match_pick(g, pick, walk.valid_vocab, list(walk.elementwise),
                       fake_tensor(g.shard).dim())


def _near(node: fx.Node, reason: str | None, readers):
    """A Miss if a reader op is at most a few ops downstream of node (on any path),
    else None: a gather nobody reads that way is not a near-miss."""
    reader = reader_within(node, lambda n: n.target in readers)
    if reader is None:
        return None
    return Miss(reason or f"an unsupported op between the gather and the {op_name(reader)}",
                reader)


def is_elementwise(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or node.target in (
        prims.convert_element_type.default, aten._to_copy.default)


def _match_pick(g, pick, valid, chain, rank) -> Verdict[GreedyPick]:
    kind = _PICKS[pick.target]
    dtype = fake_tensor(pick.args[0]).dtype
    if dtype not in FLOAT_DTYPES:
        return Miss(f"{kind} over {dtype} logits (floating point only)", pick)
    dim = arg(pick, "dim")
    if kind == "argmax":
        keepdim = bool(arg(pick, "keepdim"))
        if dim is None:
            return Miss("argmax over the flattened tensor", pick)
    elif kind == "max":
        keepdim = bool(arg(pick, "keepdim"))
        if not all(is_getitem(u) for u in pick.users):
            return Miss("max() result used as a tuple", pick)
    else:
        if not arg(pick, "largest"):
            return Miss("topk(largest=False)", pick)
        if not all(is_getitem(u) for u in pick.users):
            return Miss("topk() result used as a tuple", pick)
        keepdim = True
    if norm_dim(dim, rank) != rank - 1:
        return Miss(f"{kind} over dim {dim}, not the vocab dim", pick)
    return GreedyPick(g, valid, tuple(chain), pick, kind, keepdim)
