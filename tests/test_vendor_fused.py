"""Sites vLLM fused itself (its FlashInfer / ROCm AITER all-reduce + RMSNorm ops, on
by default from vLLM 0.33 on Hopper / Blackwell GPUs) before commfold's pass: the
report lists each as already done, by whom, with no near-miss and no second fusion;
rank-consistent (the listing enters the fingerprint). The op is a stand-in registered
under vLLM's name and schema (vLLM registers it only on CUDA with FlashInfer)."""
from __future__ import annotations

import torch

import commfold
from commfold.patterns.vendor_fused import VENDOR_FUSED, match_vendor_fusion
from commfold.report import Report, last_report

NAME = "flashinfer_trtllm_fused_allreduce_norm"


def _register():
    """vLLM's schema of the op (compilation/passes/fusion/allreduce_rms_fusion.py)."""
    if hasattr(torch.ops.vllm, NAME):
        return getattr(torch.ops.vllm, NAME).default
    lib = torch.library.Library("vllm", "FRAGMENT")
    lib.define(f"{NAME}(Tensor(a0!) allreduce_in, Tensor(a1!) residual, Tensor rms_gamma, "
               "float rms_eps, int world_size, bool launch_with_pdl, bool fp32_acc, "
               "int max_token_num, int pattern_code, Tensor(a2!)? norm_out=None, "
               "Tensor(a3!)? quant_out=None, Tensor(a4!)? scale_out=None, "
               "Tensor? scale_factor=None, float weight_bias=0.0) -> ()")

    def impl(allreduce_in, residual, rms_gamma, *args, **kwargs):  # world size 1
        residual.add_(allreduce_in)
        v = residual.float().pow(2).mean(-1, keepdim=True)
        allreduce_in.copy_((residual.float() * torch.rsqrt(v + 1e-6)).to(residual.dtype)
                           * rms_gamma)

    lib.impl(NAME, impl, "CompositeExplicitAutograd")
    lib.impl(NAME, lambda *a, **k: None, "Meta")
    _register.lib = lib  # keep the registration alive
    return getattr(torch.ops.vllm, NAME).default


def _block(x, residual, w):
    x = x * 2
    torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm(
        x, residual, w, 1e-6, 1, False, True, 128, 1)
    return x + 1, residual


def test_vllm_fused_sites_are_listed_not_fused_again():
    _register()
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    torch._dynamo.reset()
    fn = torch.compile(_block, backend=commfold.backend(passes=("fuse_allreduce_rmsnorm",)))
    out = fn(x.clone(), r.clone(), w)
    want = _block(x.clone(), r.clone(), w)
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    rep = last_report()
    assert rep.rewrites == [] and rep.near_misses == [] and rep.errors == [], rep.summary()
    (done,) = rep.already_done
    assert done.pass_name == "fuse_allreduce_rmsnorm" and "FlashInfer" in done.by
    assert "already done" in rep.summary()
    assert Report.from_dict(rep.to_dict()).already_done == rep.already_done
    bare = Report(rewrites=rep.rewrites, near_misses=rep.near_misses)
    assert bare.fingerprint() != rep.fingerprint()  # a rank that missed it would differ


def test_every_listed_op_is_matched_by_name_only():
    class Target:  # what an OpOverload exposes: its schema's name
        def __init__(self, name):
            self._schema = type("S", (), {"name": name})()
            self.__name__ = name

        def __call__(self):
            pass

    g = torch.fx.Graph()
    for name in VENDOR_FUSED:
        node = g.call_function(Target(name), ())
        assert match_vendor_fusion(node).op == name
    assert match_vendor_fusion(g.call_function(torch.ops.aten.add.Tensor, ())) is None
