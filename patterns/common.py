"""Shared recognizer vocabulary: aten op handles, the Miss result, small walkers."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Miss:
    """A recognizer's answer when a shape almost matched: why it did not."""

    reason: str
    node: fx.Node | None = None

    def __bool__(self) -> bool:  # a Miss is never a match
        return False


def is_call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_getitem(node, index=None) -> bool:
    return (is_call(node, operator.getitem)
            and (index is None or node.args[1] == index))


def users(node: fx.Node) -> list[fx.Node]:
    return list(node.users)


def only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def ndim(node: fx.Node) -> int | None:
    v = node.meta.get("val")
    return v.dim() if isinstance(v, torch.Tensor) else None


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def waits_of(node: fx.Node) -> list[fx.Node]:
    """The chain of wait_tensor nodes after a collective (a user's explicit wait adds a
    second one); empty if none."""
    chain = []
    while True:
        nxt = only_user(node)
        if nxt is None or not is_call(nxt, c10d.wait_tensor.default):
            return chain
        chain.append(nxt)
        node = nxt


def shape_of(x) -> list | None:
    if isinstance(x, fx.Node):
        v = x.meta.get("val")
        return list(v.shape) if isinstance(v, torch.Tensor) else None
    return list(x)


def same_shape(a, b) -> bool:
    """Shapes (of nodes' fake values, or lists) provably equal, symbolic sizes included."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    sa, sb = shape_of(a), shape_of(b)
    if sa is None or sb is None or len(sa) != len(sb):
        return False
    return all(statically_known_true(x == y) for x, y in zip(sa, sb))
