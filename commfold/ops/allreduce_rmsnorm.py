"""commfold::allreduce_rmsnorm - sum all-reduce, optional residual add, RMSNorm: one op.

    s   = all_reduce(x) (+ residual)  in f32;  h = round_D(s) is written into x
    out = round_O(round_R(s * rsqrt(mean(s^2, -1) + eps)) * (w + offset))

The ``.scaled`` overload scales the reduced value first, as decoders with a scaled
residual branch do (Granite's ``residual + x * multiplier``):
s = m (+ residual) with m = all_reduce(x) * scale (or / scale, SCALE_DIVIDES) in f32,
rounded to D first only when the graph rounds it there (ROUND_SCALED: emulated casts,
or an eager norm that reads m). A separate overload, so the unscaled call keeps its
argument count (each argument costs per call: norm_flags). ``.scaled_tensor`` takes the
scale as a 0-d tensor of x's dtype (Gemma's ``normalizer`` buffer, a graph input) and
runs ``.scaled`` with its value, which f32 holds exactly.

computed in f32, rounding only where asked: Inductor's CPU code keeps low-precision
intermediates in f32 (a cast down and up again is not rounded unless
``emulate_precision_casts``) but rounds what it stores, so the pass asks for
round_sum (normalize h, not s) when h is also read elsewhere (stored), and, with
emulation, for the graph's casts:
R is D when the graph casts the normalized value back to D before the weight
multiply (hand-written bf16/fp16 norms), and Gemma's 1 + w is rounded to the
weight's dtype when the graph adds it there. O is the output dtype.

Paths, chosen per call from shapes and arguments only (same on every rank):
- one-shot: all_reduce in place on x, then ONE pass over the rows (add + norm, C++
  kernel); for c10d groups and vLLM CPU's shared-memory communicator on CPU the whole
  op runs in C++ (no Python per call);
- two-shot: reduce_scatter rows, add + norm on the local rows, all_gather the normed
  output and the residual. Used when rows % world == 0 and the tensor has at least
  the threshold packed in ``flags`` (pack_flags' two_shot_min_bytes; < 0: never). The
  default comes from measurements (commfold.cost.DEFAULT_TWO_SHOT_MIN_BYTES);
- CUDA: FlashInfer's fused all-reduce + add + norm when installed and the call fits
  it (commfold.ops.flashinfer_norm; not run on a GPU here), else composite;
- composite: eager torch ops, for non-CPU tensors or when no C++ toolchain exists.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from commfold.distributed.collectives import CommKind, communicator
from commfold.ops import add_rmsnorm_cpu, flashinfer_norm
from commfold.ops.norm_flags import (OFFSET_IN_WEIGHT_DTYPE, OUT_F32, ROUND_BEFORE_WEIGHT,  # noqa: F401
                         ROUND_SCALED, ROUND_SUM, SCALE_DIVIDES,
                         TWO_SHOT_SHIFT, pack_flags)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def out_dtype_of(x: torch.Tensor, flags: int) -> torch.dtype:
    return torch.float32 if flags & OUT_F32 else x.dtype


# Mutates x: the new residual (the sum, plus the residual) is written over the input
# and the normed output returned. Graphs call it under auto_functionalized, which
# returns (normed, new residual); Inductor's reinplacing then lets it reuse a dead
# input's buffer and copies a live one (a graph input, say): no private copy when the
# input dies here, which it does in a TP layer (the row-parallel matmul's output).
# Two ops, one schema: allreduce_rmsnorm is what graphs call; on CPU its kernel is
# C++ (registered when commfold.ops.add_rmsnorm_cpu builds, on first use) and hands
# what it does not do in C++ to allreduce_rmsnorm_eager, the Python implementation.
# torch.library.Library, not custom_op: the per-call overhead is ~3 us, not ~11 us.
_ARGS = ("Tensor(a!) x, Tensor? residual, Tensor? weight, float eps, float weight_offset, "
         "int flags, str comm")
_SCHEMA = f"({_ARGS}) -> Tensor"
_lib = torch.library.Library("commfold", "FRAGMENT")
for _name in ("allreduce_rmsnorm", "allreduce_rmsnorm_eager"):
    _lib.define(_name + _SCHEMA)
    _lib.define(f"{_name}.scaled({_ARGS}, float scale) -> Tensor")


def allreduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None,
                      weight: torch.Tensor | None, eps: float, weight_offset: float,
                      flags: int, comm: str, scale: float = 1.0) -> torch.Tensor:
    """RMSNorm(all_reduce_sum(x) [* scale] [+ residual]), normed output returned; the
    new residual all_reduce_sum(x) [* scale] [+ residual] written into x."""
    c = communicator(comm)
    off_in_w, round_bw = bool(flags & OFFSET_IN_WEIGHT_DTYPE), bool(flags & ROUND_BEFORE_WEIGHT)
    round_sum, out_dtype = bool(flags & ROUND_SUM), out_dtype_of(x, flags)
    sc = Scale.of(scale, flags)
    if x.device.type in flashinfer_norm.DEVICE_TYPES:
        done = flashinfer_norm.try_run(x, residual, weight, eps, weight_offset, off_in_w,
                                       round_bw, out_dtype, c, scaled=sc is not None)
        if done is not None:
            x.copy_(done[1])
            return done[0]
    shape, hidden = x.shape, x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, hidden)
    res = None
    if residual is not None:
        res = residual if residual.dim() == 2 else residual.reshape(-1, hidden)
        res = res if res.stride(-1) == 1 else res.contiguous()
    wf = _weight_f32(weight, weight_offset, off_in_w)
    two_shot = (flags >> TWO_SHOT_SHIFT) - 1
    if _use_two_shot(c, rows, two_shot):
        world, rank = c.world_size(), c.rank()
        local = c.reduce_scatter(rows)
        part = rows.shape[0] // world
        res_local = res[rank * part:(rank + 1) * part] if res is not None else None
        out_local = _add_norm(local, res_local, wf, eps, round_bw, round_sum, out_dtype, sc)
        out, h = c.all_gather(out_local), c.all_gather(local)
    else:
        h = c.all_reduce(rows)
        out = _add_norm(h, res, wf, eps, round_bw, round_sum, out_dtype, sc)
    x.copy_(h.view(shape))
    return out.view(shape)


class Scale(NamedTuple):
    """The scaled overload's scale: m = s * value (s / value when divides), rounded to
    s's dtype when round."""

    value: float
    divides: bool
    round: bool

    @staticmethod
    def of(scale: float, flags: int) -> Scale | None:
        """None when the scale is the identity (x * 1 and x / 1 are exact)."""
        if scale == 1.0 and not flags & SCALE_DIVIDES:
            return None
        return Scale(float(scale), bool(flags & SCALE_DIVIDES), bool(flags & ROUND_SCALED))


def _first_call(x, *args):
    """Until the C++ CPU kernel is registered: load it (one build, cached), then run."""
    if x.device.type == "cpu" and add_rmsnorm_cpu.module() is not None:
        return torch.ops.commfold.allreduce_rmsnorm.default(x, *args)  # now C++
    return allreduce_rmsnorm(x, *args)


def _first_call_scaled(x, *args):
    if x.device.type == "cpu" and add_rmsnorm_cpu.module() is not None:
        return torch.ops.commfold.allreduce_rmsnorm.scaled(x, *args)  # now C++
    return allreduce_rmsnorm(x, *args)


_lib.define(f"allreduce_rmsnorm.scaled_tensor({_ARGS}, Tensor scale) -> Tensor")


def _scaled_tensor(x, residual, weight, eps, weight_offset, flags, comm, scale):
    return torch.ops.commfold.allreduce_rmsnorm.scaled(x, residual, weight, eps, weight_offset,
                                                       flags, comm, float(scale))


for _name in ("allreduce_rmsnorm_eager", "allreduce_rmsnorm_eager.scaled"):
    _lib.impl(_name, allreduce_rmsnorm, "CompositeExplicitAutograd")
_lib.impl("allreduce_rmsnorm", _first_call, "CompositeExplicitAutograd")
_lib.impl("allreduce_rmsnorm.scaled", _first_call_scaled, "CompositeExplicitAutograd")
_lib.impl("allreduce_rmsnorm.scaled_tensor", _scaled_tensor, "CompositeExplicitAutograd")


def _fake(x, residual, weight, eps, weight_offset, flags, comm, scale=1.0):
    return x.new_empty(x.shape, dtype=out_dtype_of(x, flags))


for _name in ("allreduce_rmsnorm", "allreduce_rmsnorm_eager"):
    torch.library.register_fake(f"commfold::{_name}", _fake)
    torch.library.register_fake(f"commfold::{_name}.scaled", _fake)
torch.library.register_fake("commfold::allreduce_rmsnorm.scaled_tensor", _fake)


def _use_two_shot(c, rows: torch.Tensor, min_bytes: int) -> bool:
    if min_bytes < 0 or c.kind is not CommKind.C10D:
        return False
    world, n = c.world_size(), rows.shape[0]
    return n >= world and n % world == 0 and rows.numel() * rows.element_size() >= min_bytes


def _weight_f32(weight, offset: float, in_weight_dtype: bool):
    if weight is None:
        return None
    if offset != 0.0:
        w = (weight + offset) if in_weight_dtype else weight.float() + offset
    else:
        w = weight
    if w.dtype != torch.float32:
        w = w.float()
    return w if w.dim() == 1 and w.is_contiguous() else w.reshape(-1).contiguous()


def _add_norm(h: torch.Tensor, res, wf, eps: float, round_before_weight: bool,
              round_sum: bool, out_dtype: torch.dtype, scale: Scale | None = None
              ) -> torch.Tensor:
    """In place h = h [* scale] + res (rounded to h's dtype); returns the normed rows."""
    out = torch.empty(h.shape, dtype=out_dtype, device=h.device)
    if h.device.type == "cpu" and h.shape[0] > 0 and add_rmsnorm_cpu.add_rmsnorm(
            h, res, h, out, wf, eps, round_before_weight, round_sum, scale):
        return out
    return composite_add_norm(h, res, wf, eps, round_before_weight, round_sum, out_dtype,
                              out=out, scale=scale)


def composite_add_norm(h, res, wf, eps, round_before_weight, round_sum, out_dtype, out=None,
                       scale: Scale | None = None):
    """The same math in eager torch ops (several passes over memory): the fallback
    path, and the reference the kernel is tested against."""
    hf = h.float()
    if scale is not None:  # in f32 (the f32 scalar), as Inductor computes it
        hf = hf / scale.value if scale.divides else hf * scale.value
        if scale.round:
            hf = hf.to(h.dtype).float()
    if res is not None or scale is not None:
        if res is not None:
            hf = hf + res.float()
        h.copy_(hf)
        if round_sum:
            hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if wf is not None:
        if round_before_weight:
            normed = normed.to(h.dtype).float()
        normed = normed * wf
    y = normed.to(out_dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
