"""RMSNorm as vLLM's IR ops (vLLM run with ``ir_enable_torch_wrap``), as one RMSNorm
match:

    vllm_ir.rms_norm.default(x, weight, epsilon[, variance_size=None])
    vllm_ir.rms_norm.default(h, ...) with h = add.Tensor(x, residual): a model that
        adds its (scaled) residual branch itself, then norms (Granite, MiniCPM)
    auto_functionalized(vllm_ir.fused_add_rms_norm.maybe_inplace, x=x, x_residual=r,
                        weight=w, epsilon=eps, variance_size=None)
        -> getitem 0 (normed), getitem 1 (new residual; absent when dead)
    (vLLM's graphs use auto_functionalized; torch's default auto_functionalized_v2
    passes x and x_residual as _all_bases[_x_base_index] etc.: both are read)

What they compute (vllm/ir/ops/layernorm.py; on CPU the "native" implementation runs,
eagerly, so every cast rounds): s = f32(x) [+ f32(r)], new residual = round_D(s),
n = s * rsqrt(mean(s^2) + eps), out = round_D(round_W(n) * w) where W is the weight's
dtype. So: the norm reads the f32 sum, and the normalized value is rounded to the
weight's dtype before the multiply. A weight whose dtype is neither f32 nor x's is not
matched (the product would be rounded twice, in two dtypes). After a graph's own add,
rms_norm reads the sum rounded to D (the add's stored output): sum_in_f32 is False.
vLLM's ops are looked up by name and only when registered (commfold never imports vLLM).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from commfold.fx.nodes import (arg, dtype_of, fake_tensor, is_call, is_getitem, is_number,
                            same_shape, tensor_val)

from .common import Miss, functional_kwargs, is_functionalized, optional_op
from .rmsnorm_match import RMSNorm

_ARGS = ("x", "weight", "epsilon", "variance_size")


def match_ir_norm(x: fx.Node):
    """The vllm_ir norm reading x (as its x, or as the residual of a fused add): an
    RMSNorm, a Miss, or None when no vllm_ir norm reads x."""
    rms = optional_op("vllm_ir", "rms_norm")
    fused = optional_op("vllm_ir", "fused_add_rms_norm", "maybe_inplace")
    if rms is None and fused is None:
        return None
    for user in x.users:
        if rms is not None and is_call(user, rms):
            return _rms_norm(x, user)
        if is_functionalized(user, fused):
            return _fused_add(x, user)
    return None


def _rms_norm(x, node):
    a = {name: arg(node, name) for name in _ARGS}
    if a.get("x") is not x:
        return None
    return _build(x, None, node, a, out=node, h=x, inner=())  # h: x is the residual


def match_ir_norm_of_sum(x: fx.Node, residual: fx.Node, h: fx.Node):
    """vllm_ir.rms_norm reading h = x + residual (the graph's add): an RMSNorm, a
    Miss, or None when no vllm_ir.rms_norm reads h."""
    rms = optional_op("vllm_ir", "rms_norm")
    node = next((u for u in h.users if rms is not None and is_call(u, rms)), None)
    if node is None:
        return None
    a = {name: arg(node, name) for name in _ARGS}
    if a.get("x") is not h:
        return None
    return _build(x, residual, node, a, out=node, h=h, inner=(), sum_in_f32=False)


def _fused_add(x, af):
    a = functional_kwargs(af)
    if a is None:
        return Miss("vllm_ir.fused_add_rms_norm on a view of a mutated base", af)
    if a.get("x") is x:
        residual = a.get("x_residual")
    elif a.get("x_residual") is x:
        residual = a.get("x")
    else:
        return None
    if not isinstance(residual, fx.Node) or residual is x or not same_shape(residual, x) \
            or dtype_of(residual) != dtype_of(x):
        return Miss("vllm_ir.fused_add_rms_norm operands differ in shape or dtype", af)
    outs: dict[Any, fx.Node] = {}  # getitem index -> the getitem
    for u in af.users:
        if not is_getitem(u) or u.args[1] in outs:
            return Miss("vllm_ir.fused_add_rms_norm result read other than by getitem", af)
        outs[u.args[1]] = u
    if 0 not in outs:
        return None
    if any(outs[i].users for i in outs if i not in (0, 1)):
        return Miss("vllm_ir.fused_add_rms_norm's in-place inputs are read after it", af)
    extra = tuple(outs[i] for i in sorted(outs) if i not in (0, 1))
    return _build(x, residual, af, a, out=outs[0], h=outs.get(1), inner=(af, *extra))


def _build(x, residual, node, a, out, h, inner, sum_in_f32=True):
    eps, weight = a.get("epsilon"), a.get("weight")
    if a.get("variance_size") is not None:
        return Miss("vllm_ir norm with variance_size (a partial-row variance)", node)
    if not is_number(eps):
        return Miss("vllm_ir norm eps is not a number", node)
    dtype = fake_tensor(x).dtype
    round_before = False
    if weight is not None:
        v = tensor_val(weight)
        if v is None or v.dim() != 1 or not same_shape(v.shape, [fake_tensor(x).shape[-1]]):
            return Miss("norm weight is not a [hidden] vector", node)
        if v.dtype not in (torch.float32, dtype):
            return Miss(f"vllm_ir norm weight dtype {v.dtype} differs from the input's {dtype}",
                        node)
        round_before = v.dtype != torch.float32
    return RMSNorm(x, residual, h, weight, float(eps), 0.0, False, round_before, dtype,
                   out, tuple(inner), sum_in_f32=sum_in_f32, eager=True)
