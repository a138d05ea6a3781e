"""fuse_allreduce_rmsnorm on vLLM's norm spellings, on real gloo ranks, without the
engine: vLLM's native fused add + norm as vLLM CPU traces it (the sum in f32 from
two upcasts, the new residual cast back, weight in its own dtype; the final norm
without the new residual) and vLLM's IR ops (``vllm_ir.rms_norm``,
``auto_functionalized(vllm_ir.fused_add_rms_norm.maybe_inplace)``), which run
eagerly and round at every cast. Each result matches the unfused compiled program
(f32 within 1e-5; bf16/fp16: the new residual bit-equal, the output no further from
an f64 reference) and each block is fused once."""
from __future__ import annotations

import pytest

from test_fuse_allreduce_rmsnorm import (SITES, assert_fused_once, decoders_on_rank,
                                        numerics_on_rank)

pytestmark = pytest.mark.vllm  # the ranks import vLLM's ops


def _case(dtype, norm, residual, res_first=False, tokens=(9, 40), hidden=96, eps=1e-6,
          weight=True, dead_residual=False, coll="funcol"):
    return dict(dtype=dtype, hidden=hidden, eps=eps, norm=norm, coll=coll,
                residual=residual, res_first=res_first, scale=1.0, seed=1, tokens=tokens,
                weight=weight, dead_residual=dead_residual)


# also: no weight, and a final norm whose new residual is never computed
DECOMPOSED = [_case("bf16", "vllm", True),
              _case("f16", "vllm", True, res_first=True, dead_residual=True),
              _case("bf16", "vllm_w32", True, hidden=200, eps=1e-5, coll="inplace"),
              _case("bf16", "vllm", True, weight=False, eps=0.25),
              _case("f32", "hand", False, weight=False)]


def test_vllm_native_norm_forms(ranks2):
    assert_fused_once(ranks2.run(numerics_on_rank, DECOMPOSED), DECOMPOSED)


def ir_numerics_on_rank(cases, emulate_casts):
    import vllm.ir.ops  # noqa: F401  (registers torch.ops.vllm_ir)

    return numerics_on_rank(cases, None, emulate_casts)


IR = [_case("bf16", "vllm_ir", True), _case("f16", "vllm_ir", True, res_first=True),
      _case("bf16", "vllm_ir", True, dead_residual=True, weight=False, hidden=200),
      _case("bf16", "vllm_ir", False), _case("f32", "vllm_ir", True, coll="funcol_wait")]


def test_vllm_ir_ops(ranks2):
    pytest.importorskip("vllm.ir.ops", reason="vLLM IR ops need vllm")
    per_rank = ranks2.run(ir_numerics_on_rank, IR, False)
    assert_fused_once(per_rank, IR)
    for results in per_rank:  # bf16/fp16: the eager op rounds where the fused op does,
        for r in results:     # so (almost) every element is bit-equal
            assert r["dtype"] == "torch.float32" or r["mismatch"] <= 0.02, r


def ir_decoders_on_rank(specs, tokens):
    import vllm.ir.ops  # noqa: F401

    return decoders_on_rank(specs, tokens)


def test_vllm_ir_decoder(ranks2):
    """A TP decoder whose norms are vLLM's IR ops, as vLLM's models call them: every
    boundary fused (2 x layers + 1), tokens as the eager model's."""
    pytest.importorskip("vllm.ir.ops", reason="vLLM IR ops need vllm")
    per_rank = ranks2.run(ir_decoders_on_rank, [("vllm_ir", "funcol", "bf16", False)], (5, 17))
    for (row,) in per_rank:
        assert row["counts"] and all(c == SITES for c in row["counts"]), row
        assert row["maxdiff"] <= 0.1, row
