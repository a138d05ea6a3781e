"""A constant scale on a reduced value before its residual add: decoders that scale
the branch they add to the residual stream (vLLM's Granite,
``residual + x * residual_multiplier``, its embedding ``x *= embedding_multiplier``;
MiniCPM, ``x * (scale_depth / sqrt(num_layers))``). Post-grad (torch 2.13) spells it

    m = mul.Tensor(x, c) | mul.Tensor(c, x) | div.Tensor(x, c)

with c a Python number, or a 0-d tensor of x's dtype (Gemma's ``x *= normalizer``, a
buffer: a graph input whose value the graph does not know). m keeps x's dtype (neither
promotes a float tensor). Inductor's CPU code computes m in f32 (c rounded to f32; a
0-d tensor of x's dtype is exact in f32) and inlines it into the add, unrounded; on
CUDA it turns a division by a constant into a multiply by its reciprocal. A 0-d tensor
of another dtype is no scale here: Inductor first casts it to x's dtype (rounding it),
eager ATen does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard, final

import torch.fx as fx

from commfold.fx.nodes import dtype_of, is_call, is_number, tensor_val

from .common import aten


@final
@dataclass(frozen=True)
class ResidualScale:
    x: fx.Node  # the value scaled
    scaled: fx.Node  # m, what the residual add (or the norm) reads
    value: float | fx.Node  # c: a number, or the node of a 0-d tensor of x's dtype
    divides: bool  # m = x / c (else x * c)

    @property
    def identity(self) -> bool:
        """x * 1 and x / 1 are x exactly: nothing to apply."""
        return self.value == 1.0 if self.number else False

    @property
    def number(self) -> bool:
        return not isinstance(self.value, fx.Node)


def match_residual_scale(x: fx.Node) -> ResidualScale | None:
    """The first reader of x that scales it by a number, or None."""
    for user in x.users:
        m = scale_of(user, x)
        if m is not None:
            return m
    return None


def scale_of(node: fx.Node, x: fx.Node) -> ResidualScale | None:
    """node as a scale of x by a number or a 0-d tensor of x's dtype, or None."""
    if node.kwargs or len(node.args) != 2 or dtype_of(node) != dtype_of(x):
        return None
    a, b = node.args
    if is_call(node, aten.mul.Tensor):
        c = b if a is x else a if b is x else None
        if _scalar_tensor(c, x):
            return ResidualScale(x, node, c, False)
        if is_number(c):
            return ResidualScale(x, node, float(c), False)
    if is_call(node, aten.div.Tensor) and a is x and b is not x:
        if is_number(b) and b != 0:
            return ResidualScale(x, node, float(b), True)
        if _scalar_tensor(b, x):
            return ResidualScale(x, node, b, True)
    return None


def _scalar_tensor(c, x: fx.Node) -> TypeGuard[fx.Node]:
    """c is the node of a 0-d tensor of x's dtype, on x's device (or the CPU)."""
    if not isinstance(c, fx.Node) or c is x:
        return False
    t, v = tensor_val(c), tensor_val(x)
    return (t is not None and v is not None and t.dim() == 0 and t.dtype == v.dtype
            and t.device.type in (v.device.type, "cpu"))
