"""fuse_allreduce_rmsnorm on vLLM CPU's shared-memory all-reduce, on vLLM's own TP
group in rank processes (no engine): the in-place ``_C.shm_allreduce`` on an
intermediate, in both functionalized spellings (vLLM's ``auto_functionalized``,
torch's default ``auto_functionalized_v2``), then the residual add (also of a scaled
branch, as vLLM's Granite adds it) and the norm.
Every compiled graph fuses once (the cost rule off); the new residual is bit-equal to
the unfused compiled program's and the output within f32 / bf16 rounding of it. With
the cost rule on (the default), sites below the measured sizes stay unfused with a
near-miss, sites above them fuse, and a symbolic token count counts at its lower
bound."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.vllm_models import require_vllm_installed, skip_without_shm

pytestmark = require_vllm_installed()


def shm_fusion_on_rank(v2: bool, residual_scale: float | None = None):
    import commfold
    from harness.vllm_tp import init_vllm_tp, shm_handle

    torch._dynamo.reset()
    tp = init_vllm_tp(2, shm=True)
    handle, rank = shm_handle(tp), tp.rank_in_group

    def block(x, r, w):
        y = x * 2  # an intermediate, as a projection's output is
        torch.ops._C.shm_allreduce(handle, y)
        h = y + r if residual_scale is None else r + y * residual_scale  # Granite's
        return F.rms_norm(h, (h.shape[-1],), w, 1e-6), h

    out = []
    with torch._inductor.config.patch(enable_auto_functionalized_v2=v2, fx_graph_cache=False):
        for dtype in (torch.float32, torch.bfloat16):
            torch._dynamo.reset()
            commfold.clear_reports()
            unfused = torch.compile(block, backend="inductor")
            fused = torch.compile(lambda x, r, w: block(x, r, w), backend=commfold.backend(
                passes=("fuse_allreduce_rmsnorm",), strict=True, fuse_cost_rule=False))
            for tokens in (1, 5, 33):
                g = torch.Generator().manual_seed(tokens * 10 + rank)
                x = torch.randn(tokens, 96, generator=g).to(dtype)
                r = torch.randn(tokens, 96,
                                generator=torch.Generator().manual_seed(tokens)).to(dtype)
                w = (torch.rand(96, generator=torch.Generator().manual_seed(7)) + 0.5).to(dtype)
                (n0, h0), (n1, h1) = unfused(x, r, w), fused(x, r, w)
                out.append(dict(dtype=str(dtype), tokens=tokens, h_equal=torch.equal(h0, h1),
                                out_diff=float((n0.double() - n1.double()).abs().max()),
                                scale=float(n0.double().abs().max())))
            out.append(dict(dtype=str(dtype), rewrites=[rep.count("fuse_allreduce_rmsnorm")
                                                        for rep in commfold.reports()],
                            summary=[rep.summary() for rep in commfold.reports()]))
    return out


@pytest.mark.parametrize("v2,residual_scale", [(False, None), (True, None), (False, 0.22)],
                         ids=["auto_functionalized", "v2", "scaled_residual"])
def test_shm_allreduce_norm_fuses_and_matches(vllm_ranks, v2, residual_scale):
    skip_without_shm()
    for rows in vllm_ranks.run(shm_fusion_on_rank, v2, residual_scale):
        for row in rows:
            if "rewrites" in row:
                assert row["rewrites"] and set(row["rewrites"]) == {1}, row["summary"]
                continue
            assert row["h_equal"], row
            tol = 1e-5 if row["dtype"] == "torch.float32" else 1.6e-2
            assert row["out_diff"] <= tol * max(1.0, row["scale"]), row


def cost_rule_on_rank() -> list:
    import commfold
    from harness.vllm_tp import init_vllm_tp, shm_handle

    tp = init_vllm_tp(2, shm=True)
    handle = shm_handle(tp)

    def block(x, r, w):
        y = x * 2
        torch.ops._C.shm_allreduce(handle, y)
        h = y + r
        return F.rms_norm(h, (h.shape[-1],), w, 1e-6), h

    out = []
    # (dtype, tokens, hidden, dynamic tokens): 32-bit fuses from 256 KiB, 16-bit from 2 MiB
    for dtype, tokens, hidden, dynamic in [(torch.float32, 4, 1024, False),
                                           (torch.float32, 64, 1024, False),
                                           (torch.float32, 64, 1024, True),
                                           (torch.bfloat16, 256, 1024, False),
                                           (torch.bfloat16, 256, 4096, False)]:
        torch._dynamo.reset()
        commfold.clear_reports()
        x, r = torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype)
        if dynamic:
            for a in (x, r):
                torch._dynamo.mark_dynamic(a, 0)
        w = torch.ones(hidden, dtype=dtype)
        with torch._inductor.config.patch(fx_graph_cache=False):
            torch.compile(block, backend=commfold.backend(passes=("fuse_allreduce_rmsnorm",)))(
                x, r, w)
        rep = commfold.last_report()
        out.append((rep.count("fuse_allreduce_rmsnorm"),
                    [m.reason.split(" (docs")[0] for m in rep.near_misses]))
    return out


def test_cost_rule_leaves_small_shm_sites_unfused(vllm_ranks):
    skip_without_shm()
    below = "cost rule: {} bytes (its smallest size) is below {} on vLLM CPU's " \
            "shared-memory all-reduce, where the fused op is slower in {}"
    for res in vllm_ranks.run(cost_rule_on_rank):
        assert res == [
            (0, [below.format(4 * 1024 * 4, 256 * 1024, "torch.float32")]),
            (1, []),
            # a dynamic token count counts from its lower bound (2: Dynamo's 0/1
            # specialization)
            (0, [below.format(2 * 1024 * 4, 256 * 1024, "torch.float32")]),
            (0, [below.format(256 * 1024 * 2, 2 * 2**20, "torch.bfloat16")]),
            (1, [])], res
