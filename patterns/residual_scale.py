"""A constant scale on a reduced value before its residual add: decoders that scale
the branch they add to the residual stream (vLLM's Granite,
``residual + x * residual_multiplier``, its embedding ``x *= embedding_multiplier``;
MiniCPM, ``x * (scale_depth / sqrt(num_layers))``). Post-grad (torch 2.13) spells it

    m = mul.Tensor(x, c) | mul.Tensor(c, x) | div.Tensor(x, c)    (c a Python number)

and m keeps x's dtype (a Python number never promotes a float tensor). Inductor's CPU
code computes m in f32 (c rounded to f32) and inlines it into the add, unrounded; on
CUDA it turns a division by a constant into a multiply by its reciprocal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from commfold.fx.nodes import dtype_of, is_call, is_number

from .common import aten


@dataclass(frozen=True)
class ResidualScale:
    x: fx.Node  # the value scaled
    scaled: fx.Node  # m, what the residual add (or the norm) reads
    value: float  # c
    divides: bool  # m = x / c (else x * c)

    @property
    def identity(self) -> bool:
        """x * 1 and x / 1 are x exactly: nothing to apply."""
        return self.value == 1.0


def match_residual_scale(x: fx.Node) -> ResidualScale | None:
    """The first reader of x that scales it by a number, or None."""
    for user in x.users:
        m = scale_of(user, x)
        if m is not None:
            return m
    return None


def scale_of(node: fx.Node, x: fx.Node) -> ResidualScale | None:
    """node as a scale of x by a number, or None."""
    if node.kwargs or len(node.args) != 2 or dtype_of(node) != dtype_of(x):
        return None
    a, b = node.args
    if is_call(node, aten.mul.Tensor):
        c = b if a is x else a if b is x else None
        if is_number(c):
            return ResidualScale(x, node, float(c), False)
    if is_call(node, aten.div.Tensor) and a is x and is_number(b) and b != 0:
        return ResidualScale(x, node, float(b), True)
    return None
