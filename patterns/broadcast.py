"""A residual add whose operands differ only by leading size-1 dims: a forward hook
that all-reduces a layer's ``output[0]`` ([T, H]) while the residual stream is
[1, T, H]. Broadcasting there repeats no element (same numel, same trailing shape),
so the add is the elementwise sum of the two, viewed in the wider shape, and the
fusion takes it, also after a view that only adds or removes leading 1s
(``out.unsqueeze(0) + residual``). Any other broadcast ([1, H] + [T, H], [T, 1, H] + [T, S, H])
repeats an operand's elements: no residual add, and the near-miss says so.
"""
from __future__ import annotations

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from commfold.fx.nodes import dtype_of, is_call, same_shape, shape_of

from .common import aten

# views that reshape in row-major order: with the same elements in the same order,
# a shape that differs only by leading 1s is the same tensor
_VIEWS = (aten.unsqueeze.default, aten.squeeze.dim, aten.reshape.default, aten.view.default,
          aten._unsafe_view.default)


def leading_ones_only(a, b) -> bool:
    """Shapes a and b (nodes or lists) provably differ only by leading size-1 dims
    (equal shapes included): broadcasting one against the other repeats nothing."""
    sa, sb = shape_of(a), shape_of(b)
    if sa is None or sb is None:
        return False
    return same_shape(_strip(sa), _strip(sb))


def leading_view(node: fx.Node, x: fx.Node) -> bool:
    """node views x with leading size-1 dims added or removed, nothing else
    (``out.unsqueeze(0)``, ``out.view(1, T, H)``, post-grad's reshape)."""
    return is_call(node, *_VIEWS) and bool(node.args) and node.args[0] is x \
        and dtype_of(node) == dtype_of(x) and leading_ones_only(node, x)


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
