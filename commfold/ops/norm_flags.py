"""The option bits of commfold::allreduce_rmsnorm's ``flags`` argument: their one
definition, read by the Python op, the pass that packs them and the C++ kernel (as
-D defines)."""
from __future__ import annotations

# The op's options travel packed in one int: a custom op call from Inductor's Python
# wrapper costs about 0.45 us per argument (11 arguments measured 5.8 us, 7 about 3.9),
# against a ~6 us shared-memory all-reduce at decode sizes (docs/passes.md,
# fuse_allreduce_rmsnorm: the CPU op's per-call path).
OFFSET_IN_WEIGHT_DTYPE = 1  # Gemma's 1 + w is computed (rounded) in the weight's dtype
ROUND_BEFORE_WEIGHT = 2     # the normalized value is rounded to x's dtype before * w
ROUND_SUM = 4               # normalize the stored (rounded) new residual, not the f32 sum
OUT_F32 = 8                 # the normed output is f32 (else x's dtype)
SCALE_DIVIDES = 16          # the scaled overload divides the reduced value by its scale
ROUND_SCALED = 32           # the scaled value is rounded to x's dtype before the add
TWO_SHOT_SHIFT = 8          # flags >> 8: two-shot from this many bytes + 1 (0: never)


def pack_flags(offset_in_weight_dtype: bool = False, round_before_weight: bool = False,
               round_sum: bool = False, out_f32: bool = False,
               two_shot_min_bytes: int = -1, scale_divides: bool = False,
               round_scaled: bool = False) -> int:
    """The op's `flags` argument (two_shot_min_bytes < 0: one-shot only)."""
    return (OFFSET_IN_WEIGHT_DTYPE * bool(offset_in_weight_dtype)
            | ROUND_BEFORE_WEIGHT * bool(round_before_weight) | ROUND_SUM * bool(round_sum)
            | OUT_F32 * bool(out_f32) | SCALE_DIVIDES * bool(scale_divides)
            | ROUND_SCALED * bool(round_scaled)
            | (max(two_shot_min_bytes, -1) + 1) << TWO_SHOT_SHIFT)
