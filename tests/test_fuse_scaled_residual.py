"""fuse_allreduce_rmsnorm on a scaled residual branch, residual + all_reduce(x) * c
(vLLM's Granite residual and embedding multipliers, MiniCPM's scale_depth), on real
gloo ranks: each site fused once (the op's scaled overloads: by a number, by a 0-d
tensor as Gemma's normalizer), the new residual
bit-equal to the unfused compiled program's, the normed output within its
tolerances (f32 1e-5 relative; bf16/fp16 no further from an f64 reference), the
graph's own collective once, for every scale spelling and scales negative, tiny,
large and 1.0."""
from __future__ import annotations

import math

import pytest
from hypothesis import strategies as st

from harness.draws import drawn
from harness.models_norm import (EMULATED_CASTS_ROUND_LESS, EMULATED_CASTS_WHY,
                                 fused_decoder_sites)
from test_fuse_allreduce_rmsnorm import (assert_fused_once, assert_sites_fused, DTYPES, SITES,
                                         decoders_on_rank, numerics_on_rank)

# Granite's residual_multiplier (0.22), MiniCPM's scale_depth / sqrt(layers), and the
# edges: the identity, a sign flip, tiny, large
SCALES = [1.0, -1.0, 0.22, 1.4 / math.sqrt(40), -3.7, 1e-6, 2.0**-20, 12.0]


def _case(dtype, norm, residual, scale, spelling="mul", coll="funcol", res_first=False,
          tokens=(9, 40), hidden=96, eps=1e-6, weight=True, dead_residual=False, seed=1):
    return dict(dtype=dtype, hidden=hidden, eps=eps, norm=norm, coll=coll,
                residual=residual, res_first=res_first, scale=1.0, seed=seed, tokens=tokens,
                weight=weight, dead_residual=dead_residual, residual_scale=scale,
                scale_spelling=spelling)


# every spelling of the scale, each norm family, with and without a residual (Granite's
# embedding), a final norm (new residual dead), no weight, every dtype
FIXED = [_case("bf16", "hand", True, 0.22),
         _case("f32", "functional", True, -3.7, "rmul", coll="funcol_wait", res_first=True),
         _case("f16", "gemma", True, 1e-6, coll="inplace"),
         _case("f32", "gemma", True, 3.0, "div", coll="inplace"),
         _case("bf16", "vllm", True, 1.4 / math.sqrt(40), dead_residual=True),
         _case("f16", "vllm_w32", True, 12.0, "imul", hidden=200),
         _case("bf16", "functional", False, 12.0, "imul", coll="inplace"),
         _case("f32", "hand", False, 0.5, weight=False),
         _case("bf16", "gemma_lowp", True, 1.0, "mul", eps=0.25),
         # by a 0-d tensor of the value's dtype, a graph input: Gemma's embedding
         # `x *= normalizer` (no residual), and a divisor with a residual
         _case("bf16", "gemma", False, 96**0.5, "itensor", coll="inplace"),
         _case("f32", "hand", True, -3.7, "tdiv", res_first=True)]


def test_scaled_spellings(ranks2):
    assert_fused_once(ranks2.run(numerics_on_rank, FIXED), FIXED)


@pytest.mark.skipif(EMULATED_CASTS_ROUND_LESS, reason=EMULATED_CASTS_WHY)
def test_scaled_emulated_precision_casts(ranks2):
    """With emulate_precision_casts Inductor rounds the scaled value to its dtype before
    the add: the op is asked to round there too, (almost) every element bit-equal."""
    cases = [_case("bf16", "hand", True, 0.22, tokens=(33,)),
             _case("f16", "vllm", True, -3.7, "div", tokens=(33,))]
    per_rank = ranks2.run(numerics_on_rank, cases, None, True)
    assert_fused_once(per_rank, cases)
    for results in per_rank:
        for r in results:
            assert r["mismatch"] <= 0.02, r


def _in_range(case):
    """A divisor of at least 1 in magnitude: x / tiny overflows fp16 (NaN both ways)."""
    c = case["residual_scale"]
    if case["scale_spelling"] in ("div", "tdiv") and abs(c) < 1.0:
        case = dict(case, residual_scale=1.0 / c)
    return case


scaled_case = st.fixed_dictionaries({
    "dtype": st.sampled_from(sorted(DTYPES)),
    "hidden": st.sampled_from([8, 48, 200, 1024]),
    "eps": st.sampled_from([1e-6, 1e-5, 0.25]),
    "norm": st.sampled_from(["hand", "functional", "gemma", "gemma_lowp", "vllm", "vllm_w32"]),
    "coll": st.sampled_from(["funcol", "funcol_wait", "inplace"]),
    "residual": st.booleans(),
    "res_first": st.booleans(),
    "residual_scale": st.one_of(st.sampled_from(SCALES),
                                st.floats(-64.0, 64.0).filter(lambda c: abs(c) >= 2.0**-30)),
    "scale_spelling": st.sampled_from(["mul", "rmul", "div", "imul", "tensor", "itensor",
                                       "tdiv"]),
    "scale": st.sampled_from([1.0, 1e-3, 30.0]),
    "seed": st.integers(0, 10_000),
    "tokens": st.tuples(st.integers(2, 300), st.just(1)),
}).map(_in_range)


# Each case compiles four programs per rank (fused and unfused, T dynamic and T=1):
# three distinct drawn cases (harness.draws; COMMFOLD_HYPOTHESIS=random: fresh ones)
def test_scaled_matches_unfused_program(ranks2):
    cases = drawn(scaled_case, 3)
    assert len(cases) == 3
    assert_fused_once(ranks2.run(numerics_on_rank, cases), cases)


def test_scaled_decoder(ranks2):
    """A TP decoder whose every reduced branch is scaled (the input projection's too,
    as Granite's embedding): every site fused (2 per layer + 1; torch < 2.13: see
    assert_sites_fused), on both ranks alike."""
    specs = [("hand", "funcol", "f32", False, 0.22), ("vllm", "inplace", "bf16", True, -1.5)]
    per_rank = ranks2.run(decoders_on_rank, specs, (5, 17))
    for rows in per_rank:
        for row in rows:
            assert_sites_fused(row)
            norm, _, dtype = row["spec"]
            if fused_decoder_sites(norm, DTYPES[dtype], SITES) == SITES:
                assert not row["misses"], row
            tol = 1e-4 if row["spec"][2] == "f32" else 0.1
            assert row["maxdiff"] <= tol, row
    assert all(a["fingerprints"] == b["fingerprints"] for a, b in zip(*per_rank))


def ir_scaled_on_rank(cases):
    import vllm.ir.ops  # noqa: F401  (registers torch.ops.vllm_ir)

    return numerics_on_rank(cases)


@pytest.mark.vllm(group="module")  # imports vLLM's IR ops, here and on its ranks
def test_scaled_vllm_ir(ranks2):
    """vLLM's IR norms after a scaled branch: fused_add_rms_norm(x * c, residual) reads
    the scaled value as a stored (rounded) input; rms_norm(residual + x * c) the
    graph's rounded sum."""
    pytest.importorskip("vllm.ir.ops", reason="vLLM IR ops need vllm")
    cases = [_case("bf16", "vllm_ir", True, 0.22), _case("f16", "vllm_ir", False, 12.0),
             _case("bf16", "vllm_ir_rms", True, -3.7, res_first=True),
             _case("f32", "vllm_ir_rms", True, 3.0, "div")]
    assert_fused_once(ranks2.run(ir_scaled_on_rank, cases), cases)
