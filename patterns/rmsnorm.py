"""Residual add + RMSNorm after a value, in the aten spellings Inductor's post-grad
graphs hold (torch 2.13, CPU):

    h = x + residual            (either operand order; optional; the two may differ
                                 by leading size-1 dims, x read through a view
                                 adding or removing them: patterns.broadcast;
                                 vllm_ir.rms_norm(h): patterns.rmsnorm_vllm)
    hf = h | convert(h, f32)    (bf16/fp16 norms upcast)
  or, vLLM's bf16/fp16 fused add + norm (its native decomposition):
    hf = convert(x, f32) + convert(residual, f32)   (the norm reads the f32 sum)
    h = convert(hf, D)          (the new residual; absent when dead, e.g. final norm)
    n = hf * rsqrt(mean(hf^2 | hf*hf, [last dim], keepdim) + eps)   (add.Tensor or
                                 add.Scalar; eps any number, read from the graph)
    then one of:
      convert(n, D) [* w]          hand-written bf16/fp16: cast back, then weight
      n * w' [-> convert(., D)]    f32, F.rms_norm / nn.RMSNorm, Gemma: multiply in f32,
                                   cast last; w' = w | convert(w, f32) | w' + offset
      nothing                      no weight

The match says how the graph rounds (round_before_weight, out_dtype, whether Gemma's
offset is added in the weight's dtype, whether the norm reads the f32 sum), so a
fused kernel can round the same way. vLLM's IR ops (vllm_ir.rms_norm,
vllm_ir.fused_add_rms_norm) are recognized by patterns.rmsnorm_vllm.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from commfold.fx.nodes import (arg, dtype_of, fake_tensor, is_call, is_number, only_user,
                            same_shape, tensor_val)

from .broadcast import leading_ones_only, leading_view
from .common import Miss, Recognized, Verdict, aten, prims
from .rmsnorm_match import RMSNorm
from .rmsnorm_vllm import match_ir_norm, match_ir_norm_of_sum

__all__ = ["RMSNorm", "match_rmsnorm"]  # RMSNorm: the match type, re-exported


def _cast_to(node: fx.Node, dtype=None) -> bool:
    """node is convert_element_type(., dtype) / _to_copy(., dtype=dtype) (any dtype if None)."""
    if is_call(node, prims.convert_element_type.default):
        return dtype is None or node.args[1] == dtype
    if is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"}:
        return dtype is None or node.kwargs.get("dtype") == dtype
    return False


def _other(node: fx.Node, x: fx.Node):
    """For a binary op reading x once, its other operand (None if x is not an operand)."""
    a, b = node.args[:2]
    if a is x and b is not x:
        return b
    if b is x and a is not x:
        return a
    return None


def match_rmsnorm(x: fx.Node) -> Recognized[RMSNorm]:
    """The residual add + RMSNorm reading x; a Miss when one almost matches; None when
    no RMSNorm reads x. A norm reading x itself wins over one reading x + residual
    (then x is also the new residual, read by a later add)."""
    ir = match_ir_norm(x)
    if ir is not None:
        return ir
    direct = _match_norm(x, None, x)
    if direct:
        return direct
    found = direct
    for src, user in _adds_of(x):
        residual = _other(user, src)
        if isinstance(residual, fx.Node) and leading_ones_only(residual, src) \
                and dtype_of(residual) == dtype_of(src) == dtype_of(user):
            m = _match_norm(src, residual, user)
            if m is None:
                m = match_ir_norm_of_sum(src, residual, user)
            if m and src is not x:
                m = replace(m, x=x, x_view=src)
            if m:
                return m
            found = found or m
    if dtype_of(x) in (torch.bfloat16, torch.float16):
        for up in [u for u in x.users if _cast_to(u, torch.float32)]:
            for s in [u for u in up.users if is_call(u, aten.add.Tensor) and len(u.args) == 2
                      and not u.kwargs]:
                m = _match_f32_sum(x, up, s)
                if m:
                    return m
                found = found or m
    return found


def _adds_of(x: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(operand, add) for each binary add reading x, or a leading-1 view of x."""
    srcs = [x, *[v for v in x.users if leading_view(v, x)]]
    return [(src, u) for src in srcs for u in list(src.users)
            if is_call(u, aten.add.Tensor) and len(u.args) == 2 and not u.kwargs]


def _match_f32_sum(x, up, s) -> Recognized[RMSNorm]:
    """s = convert(x, f32) + convert(residual, f32): vLLM's fused add + norm."""
    cr = _other(s, up)
    if isinstance(cr, fx.Node) and dtype_of(cr) == torch.float32 and leading_ones_only(cr, x) \
            and not _cast_to(cr, torch.float32) and any(_is_square(u, s) for u in s.users):
        return Miss(f"the residual is float32, not {dtype_of(x)}: {F32_STREAM}", s)
    if not (isinstance(cr, fx.Node) and _cast_to(cr, torch.float32)):
        return None
    residual = cr.args[0]
    if not (isinstance(residual, fx.Node) and dtype_of(residual) == dtype_of(x)
            and same_shape(residual, x)):
        return None
    if len(up.users) != 1:
        return Miss("the upcast reduced value is read outside the norm", up)
    downs = [u for u in s.users if _cast_to(u, dtype_of(x))]
    if len(downs) > 1:
        return Miss("the f32 sum is cast back more than once", s)
    h = downs[0] if downs else None
    m = _match_norm(x, residual, h, hf=s, pre=(up,))
    if h is None and isinstance(m, Miss) and m.node is s:  # read elsewhere, never cast back
        return Miss(f"the f32 sum is read outside the norm and never cast back to "
                    f"{dtype_of(x)}: {F32_STREAM}", s)
    return m


# The f32-sum spelling whose new residual stays f32 between layers: vLLM's native norm
# casts it back to the model's dtype, and torch 2.11-2.12's joint-graph pass
# pointless_convert drops that f32 -> bf16 -> f32 round trip (2.13 keeps it).
F32_STREAM = ("a float32 residual stream (torch before 2.13 drops vLLM's cast back to the "
              "model's dtype, or the model keeps its residual in float32); the fused op "
              "keeps the residual in the model's dtype")


def _match_norm(x, residual, h, hf=None, pre=()) -> Recognized[RMSNorm]:
    dtype = dtype_of(x)
    if hf is None:
        hf = h
        if dtype not in (torch.float32, torch.float64):  # low precision: upcast first
            # the upcast the norm squares (vLLM also upcasts h apart, as a residual)
            ups = [u for u in h.users if _cast_to(u, torch.float32)
                   and any(_is_square(v, u) for v in u.users)]
            if len(ups) != 1:
                return None
            hf = ups[0]
    sq = next((u for u in hf.users if _is_square(u, hf)), None)
    if sq is None:
        return None
    mean = only_user(sq)
    if not is_call(mean, aten.mean.dim):
        return None
    rank = fake_tensor(hf).dim()  # x's rank, or wider: a leading-1 broadcast add
    dims, keepdim = arg(mean, "dim"), arg(mean, "keepdim")
    if arg(mean, "dtype") not in (None, torch.float32):
        return Miss("mean of squares in a dtype other than float32", mean)
    if list(dims) != [rank - 1] and list(dims) != [-1] or not keepdim:
        return Miss(f"norm over dims {list(dims)}, not the last (hidden) dim", mean)
    add_eps = only_user(mean)
    if not is_call(add_eps, aten.add.Tensor, aten.add.Scalar) or add_eps.kwargs:
        return Miss("mean of squares not followed by + eps", mean)
    eps = _other(add_eps, mean)
    if not is_number(eps):
        return Miss("eps is not a number", add_eps)
    rsqrt = only_user(add_eps)
    if not is_call(rsqrt, aten.rsqrt.default):
        return Miss("variance + eps not followed by rsqrt", add_eps)
    normed = only_user(rsqrt)
    if not is_call(normed, aten.mul.Tensor) or _other(normed, rsqrt) is not hf:
        return Miss("rsqrt does not scale the norm's input", rsqrt)
    if hf is not h and not set(hf.users) <= {sq, normed, h}:
        return Miss("the upcast input is read outside the norm", hf)
    inner = [*pre, *[n for n in (hf if hf is not h else None, sq, mean, add_eps, rsqrt) if n]]
    return _match_tail(x, residual, h, float(eps), normed, inner, dtype, sum_in_f32=bool(pre))


def _match_tail(x, residual, h, eps, normed, inner, dtype, sum_in_f32=False) -> Verdict[RMSNorm]:
    """After n = hf * rsqrt(...): the optional cast back and weight multiply."""
    cur, round_before = normed, False
    weight, offset, off_in_w = None, 0.0, False
    nxt = only_user(cur)
    if dtype not in (torch.float32, torch.float64) and nxt is not None and _cast_to(nxt, dtype):
        inner.append(cur)
        cur, round_before, nxt = nxt, True, only_user(nxt)  # hand-written: cast back first
    if nxt is not None and is_call(nxt, aten.mul.Tensor) and len(nxt.args) == 2:
        parsed = _weight(_other(nxt, cur), x)
        if isinstance(parsed, Miss):
            return parsed
        if parsed is not None:
            weight, offset, off_in_w = parsed
            inner.append(cur)
            cur, nxt = nxt, only_user(nxt)
            if not round_before and nxt is not None and _cast_to(nxt, dtype) \
                    and dtype_of(cur) == torch.float32:
                inner.append(cur)  # F.rms_norm / Gemma: weight in f32, cast last
                cur = nxt
    if weight is None:
        round_before = False
    out_dtype = dtype_of(cur)
    if out_dtype is None or out_dtype not in (torch.float32, dtype):
        return Miss(f"norm output in {out_dtype} (neither f32 nor the input dtype)", cur)
    for n in inner:  # the norm's intermediates must not be read elsewhere
        if any(u not in inner and u is not cur and (h is None or u is not h) for u in n.users):
            return Miss("an intermediate of the norm is read outside it", n)
    return RMSNorm(x, residual, h, weight, eps, offset, off_in_w, round_before, out_dtype,
                   cur, tuple(inner), sum_in_f32=sum_in_f32)


def _weight(w, x) -> Recognized[tuple]:
    """(raw weight, offset, offset added in the weight's dtype) for the weight operand
    w: w | convert(w, f32) | (w | convert(w, f32)) + number; None if w is not a weight."""
    if not isinstance(w, fx.Node):
        return None
    offset, off_in_w = 0.0, False
    if is_call(w, aten.add.Tensor) and len(w.args) == 2 and not w.kwargs:
        a, b = w.args
        num, base = (a, b) if is_number(a) else (b, a)
        if not is_number(num) or not isinstance(base, fx.Node):
            return None
        offset, w = float(num), base
        off_in_w = True
    if _cast_to(w, torch.float32):
        w, off_in_w = w.args[0], False
    v = tensor_val(w) if isinstance(w, fx.Node) else None
    hidden = fake_tensor(x).shape[-1]
    if v is None or v.dim() != 1 or not same_shape(v.shape, [hidden]):
        return Miss("norm weight is not a [hidden] vector", w)
    if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return Miss(f"norm weight in unsupported dtype {v.dtype}", w)
    return w, offset, off_in_w and v.dtype != torch.float32


def _is_square(node, x) -> bool:
    if is_call(node, aten.pow.Tensor_Scalar):
        return node.args[0] is x and bool(node.args[1] == 2)
    return is_call(node, aten.mul.Tensor) and node.args[0] is x and node.args[1] is x
