"""A one-pass CPU kernel for residual-add + RMSNorm (add_rmsnorm_cpu.cpp), built once
on the machine that runs it (commfold.ops.cpp_build: cached, keyed on the source,
the flags and the CPU).

Per row: s = x + residual in f32, h = round_D(s) is written out and the sum of squares
of s (or of h, round_h) taken in the same sweep (an OpenMP simd reduction, so it
vectorizes without -ffast-math; bf16 on its bits, fp16 with F16C); s stays in a
row-sized f32 scratch, in cache for the second sweep
y = round_O(round_R(s * rsqrt(mean + eps)) * w).
Rounding follows the graph it replaces: R is the dtype the normalized value is cast
to before the weight multiply (f32 when the graph multiplies in f32), O the output
dtype. Rows run in parallel with at::parallel_for.

A scale (the op's scaled overload) takes x * c (or x / c) first, in f32 with c
rounded to f32 as Inductor's code does, optionally rounded to x's dtype, into the
row's f32 scratch; the add reads it from there, so h is written even without a
residual. The multiply and the add stay separate roundings (no FMA: Inductor
compiles with -ffp-contract=off). fp16 rows with a scale take the generic loops.

Loading the module also registers commfold::allreduce_rmsnorm's CPU kernel in C++
(c10d groups, one-shot); ``add_rmsnorm(...)`` returns False when no C++ toolchain is
available and the caller uses the composite (eager) path.
"""
from __future__ import annotations

from pathlib import Path

from commfold.ops import cpp_build, norm_flags

SOURCE = Path(__file__).parent / "csrc" / "add_rmsnorm_cpu.cpp"


def module():
    """The compiled extension, or None when it cannot be built here."""
    return cpp_build.load("commfold_add_rmsnorm", SOURCE, defines={
        "COMMFOLD_OFFSET_IN_WEIGHT_DTYPE": norm_flags.OFFSET_IN_WEIGHT_DTYPE,
        "COMMFOLD_ROUND_BEFORE_WEIGHT": norm_flags.ROUND_BEFORE_WEIGHT,
        "COMMFOLD_ROUND_SUM": norm_flags.ROUND_SUM,
        "COMMFOLD_OUT_F32": norm_flags.OUT_F32,
        "COMMFOLD_SCALE_DIVIDES": norm_flags.SCALE_DIVIDES,
        "COMMFOLD_ROUND_SCALED": norm_flags.ROUND_SCALED,
        "COMMFOLD_TWO_SHOT_SHIFT": norm_flags.TWO_SHOT_SHIFT})


def add_rmsnorm(x, residual, h, out, weight_f32, eps: float, round_before_weight: bool,
                round_h: bool = False, scale=None) -> bool:
    """Run the kernel on [N, H] views; False when the kernel is unavailable.
    round_h: normalize the sum rounded to x's dtype (else the exact f32 sum);
    scale: an allreduce_rmsnorm.Scale applied to x before the add, or None."""
    m = module()
    if m is None:
        return False
    value, divides, round_scaled = (1.0, False, False) if scale is None else scale
    m.add_rmsnorm(x, residual, h, out, weight_f32, float(eps), bool(round_before_weight),
                  bool(round_h), float(value), bool(divides), bool(round_scaled))
    return True
