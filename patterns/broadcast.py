"""A residual add whose operands differ only by leading size-1 dims: a forward hook
that all-reduces a layer's ``output[0]`` ([T, H]) while the residual stream is
[1, T, H]. Broadcasting there repeats no element (same numel, same trailing shape),
so the add is the elementwise sum of the two, viewed in the wider shape, and the
fusion takes it. Any other broadcast ([1, H] + [T, H], [T, 1, H] + [T, S, H])
repeats an operand's elements: no residual add, and the near-miss says so.
"""
from __future__ import annotations

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from commfold.fx.nodes import same_shape, shape_of


def leading_ones_only(a, b) -> bool:
    """Shapes a and b (nodes or lists) provably differ only by leading size-1 dims
    (equal shapes included): broadcasting one against the other repeats nothing."""
    sa, sb = shape_of(a), shape_of(b)
    if sa is None or sb is None:
        return False
    return same_shape(_strip(sa), _strip(sb))


def _strip(shape: list) -> list:
    i = 0
    while i < len(shape) and statically_known_true(shape[i] == 1):
        i += 1
    return shape[i:]


def repeated(x: fx.Node, other: fx.Node, out: fx.Node) -> str | None:
    """Whose elements an add of x and other (output out) repeats, as a reason names
    them ('its' for x's, 'the other operand's', 'both operands''); None when it
    repeats none (not provably: symbolic sizes)."""
    so = shape_of(out)
    if so is None:
        return None
    mine, theirs = (not leading_ones_only(n, so) for n in (x, other))
    if mine and theirs:
        return "both operands'"
    return "its" if mine else "the other operand's" if theirs else None


def shape_text(node: fx.Node) -> str:
    """[3, 16], [s0, 16]: a node's shape as reasons print it."""
    return "[" + ", ".join(str(d) for d in shape_of(node) or ()) + "]"
