"""Every sum all-reduce that reaches an RMSNorm is fused or explained: the pass
fuse_allreduce_rmsnorm run (without ranks, on post-grad graphs of a fake process
group) over every spelling the fusion tests build - harness/models_norm.py's blocks and
decoders, with and without a scaled residual branch, and the differential fuzz's norm
blocks - and over deliberately unfusable ones. Each all-reduce within a few
elementwise ops of a norm is rewritten, or the report holds a near-miss naming why.
The numerics of what is fused are the rank tests' (test_fuse_*.py)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from harness.post_grad import fake_world, post_grad, vllm_ir_ops

import commfold
from harness import fuzz_programs as fp
from commfold.patterns.allreduce import allreduce_candidates, match_allreduce
from commfold.patterns.norm_reach import norm_path
from harness.models_norm import (F32_STREAM_MISS, NORMS, TPDecoder, fused_decoder_sites,
                                 make_block)

PASS = "fuse_allreduce_rmsnorm"
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
T, H = 3, 16


@pytest.fixture(scope="module")
def group():
    with fake_world(2) as g:
        yield g


def run_pass(fn, *inputs):
    """(reaching, unfused, report): the all-reduces of fn's post-grad graph whose value
    reaches an RMSNorm, those the pass left, and its report."""
    g = post_grad(fn, *inputs)
    reaching = []
    for coll in allreduce_candidates(g):
        ar = match_allreduce(coll)
        if norm_path(ar.reduced if ar else coll) is not None:
            reaching.append(coll)
    commfold.CommfoldPass(commfold.Config(passes=(PASS,), strict=True))(g)
    return reaching, [c for c in reaching if not c._erased], commfold.last_report()


def assert_fused_or_explained(fn, *inputs, fused=None):
    reaching, unfused, rep = run_pass(fn, *inputs)
    assert reaching, "no all-reduce reaches a norm: the spelling tests nothing"
    # each all-reduce left has its own near-miss (one per collective at most)
    assert len(rep.near_misses) >= len(unfused), rep.summary()
    assert rep.count(PASS) + len(rep.near_misses) >= len(reaching), rep.summary()
    if fused is not None:
        assert rep.count(PASS) == fused, rep.summary()
    return rep


def _block_inputs(dtype):
    return (torch.randn(T, H, dtype=dtype), torch.randn(T, H, dtype=dtype),
            torch.randn(H, dtype=dtype))


SCALED = [None, (0.22, "mul"), (-3.7, "rmul"), (3.0, "div"), (12.0, "imul"), (1.0, "mul")]


def _block_specs():
    """Every norm x residual x scale spelling; the other options rotate through them."""
    rot = itertools.cycle(itertools.product(
        ["f32", "bf16", "f16"], ["funcol", "funcol_wait"], [False, True], [True, False],
        [False, True]))
    for norm in [n for n in NORMS if not n.startswith("vllm_ir")]:
        for residual in (True, False):
            for scaled in SCALED:
                yield (norm, residual, scaled, *next(rot))


@pytest.mark.parametrize("norm", [n for n in NORMS if not n.startswith("vllm_ir")])
def test_every_block_spelling_is_fused(group, norm):
    for spec in [s for s in _block_specs() if s[0] == norm]:
        _, residual, scaled, dtype, coll, res_first, weight, dead = spec
        weight = weight or norm in ("gemma", "gemma_lowp", "vllm_w32")  # these need one
        scale, spelling = scaled or (None, "mul")
        fn = make_block(norm, coll, residual, res_first, 1e-6, weight, dead, scale, spelling)
        assert_fused_or_explained(fn, *_block_inputs(DT[dtype]), fused=1)


@pytest.mark.vllm(group="module")  # imports vLLM in this process
def test_vllm_ir_spellings_are_fused(group):
    vllm_ir_ops()
    for norm, residual, scaled in itertools.product(["vllm_ir", "vllm_ir_rms"], [True, False],
                                                    SCALED[:3]):
        if norm == "vllm_ir_rms" and not residual:
            continue  # the same program as vllm_ir's rms_norm
        scale, spelling = scaled or (None, "mul")
        fn = make_block(norm, "funcol", residual, False, 1e-6, True, False, scale, spelling)
        assert_fused_or_explained(fn, *_block_inputs(torch.bfloat16), fused=1)


@pytest.mark.parametrize("scale", [None, 0.5], ids=["plain", "scaled"])
def test_decoders(group, scale):
    """models_norm's TP decoder (2 layers: 5 norm sites), every norm family (vLLM's in
    16 bits on torch < 2.13: the first site, the others a near-miss naming why)."""
    for norm, coll, dtype in [("hand", "funcol", "f32"), ("nn", "funcol_wait", "bf16"),
                              ("gemma", "funcol", "bf16"), ("vllm", "funcol", "f16")]:
        torch.manual_seed(0)
        model = TPDecoder(2, 32, 64, norm, coll, 2, residual_scale=scale).to(DT[dtype])
        names, params = zip(*model.named_parameters())

        def fn(x, *weights, model=model, names=names):  # weights as graph inputs
            return torch.func.functional_call(model, dict(zip(names, weights)), (x,))

        rep = assert_fused_or_explained(fn, torch.randn(T, 32, dtype=DT[dtype]),
                                        *(p.detach() for p in params),
                                        fused=fused_decoder_sites(norm, DT[dtype], 5))
        if rep.count(PASS) < 5:
            assert all(F32_STREAM_MISS in m.reason for m in rep.near_misses), rep.summary()


def test_fuzz_norm_blocks(group):
    """The differential fuzz's norm blocks: sums fused, other reductions explained."""
    for coll, norm, dtype, residual, reduce, scale in itertools.product(
            ["funcol", "funcol_wait"], ["hand", "functional", "gemma"], ["f32", "bf16"],
            [True, False], ["sum", "avg"], [None, -0.75]):
        b = dict(kind="norm", seed=1, coll=coll, norm=norm, dtype=dtype, tokens=3, hidden=8,
                 residual=residual, eps=1e-6, reduce=reduce, scale=scale)
        rep = assert_fused_or_explained(fp.build([b]), *fp.block_inputs(b),
                                        fused=1 if reduce == "sum" else 0)
        if reduce != "sum":
            assert "'avg' all-reduce" in rep.near_misses[0].reason
    for broadcast, dtype, scale in itertools.product(["res1", "x1", "unsqueeze"],
                                                     ["f32", "bf16"], [None, -0.75]):
        b = dict(kind="norm", seed=1, coll="funcol", norm="hand", dtype=dtype, tokens=3,
                 hidden=8, residual=True, eps=1e-6, reduce="sum", scale=scale,
                 broadcast=broadcast)
        rep = assert_fused_or_explained(fp.build([b]), *fp.block_inputs(b), fused=1)
        assert not rep.near_misses, rep.summary()


def _tanh(group):
    def fn(x, r, w):
        h = r + torch.tanh(funcol.all_reduce(x, "sum", group))
        return F.rms_norm(h, (H,), w, 1e-6), h
    return fn


def _scale_after_add(group):
    def fn(x, r, w):
        h = (funcol.all_reduce(x, "sum", group) + r) * 0.5
        return F.rms_norm(h, (H,), w, 1e-6), h
    return fn


def _double_scale(group):
    def fn(x, r, w):
        h = funcol.all_reduce(x, "sum", group) * 2.0 * 0.5 + r
        return F.rms_norm(h, (H,), w, 1e-6), h
    return fn


TANH = ("aten.tanh.default between all_reduce and rmsnorm: not a residual add, one scale by "
        "a constant or a float32 upcast")
UNFUSABLE = {"_tanh": TANH,
             "_scale_after_add": "aten.mul.Tensor scales the sum after the residual add (a "
                                 "scale is fused only before the add)",
             "_double_scale": "aten.mul.Tensor scales the all-reduce's value a second time "
                              "(one scale is fused)"}


@pytest.mark.parametrize("name", sorted(UNFUSABLE))
def test_an_unfusable_op_in_between_is_named(group, name):
    rep = assert_fused_or_explained(globals()[name](group), *_block_inputs(torch.bfloat16),
                                    fused=0)
    assert [m.reason for m in rep.near_misses] == [UNFUSABLE[name]]


def test_an_unfused_reduced_value_reaching_a_fused_norm_is_explained(group):
    """An all-reduce whose value joins another's residual stream through a tanh: the
    other site is fused, this one named."""
    def fn(x, y, w):
        a = torch.tanh(funcol.all_reduce(x, "sum", group))
        h = funcol.all_reduce(y, "sum", group) + a
        return F.rms_norm(h, (H,), w, 1e-6), h

    rep = assert_fused_or_explained(fn, *_block_inputs(torch.float32), fused=1)
    assert [m.reason for m in rep.near_misses] == \
        [TANH]


def test_flashinfer_devices_keep_scaled_sites_unfused(group, monkeypatch):
    """FlashInfer's fusion has no scale: on its devices a scaled site stays unfused,
    with the reason; an unscaled one is fused (the CPU tensors here stand in)."""
    from commfold.ops import flashinfer_norm

    monkeypatch.setattr(flashinfer_norm, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(flashinfer_norm, "flashinfer_comm", object)  # "installed"
    inputs = _block_inputs(torch.bfloat16)
    rep = assert_fused_or_explained(make_block("hand", "funcol", True, False, 1e-6,
                                               scale=0.22), *inputs, fused=0)
    assert [m.reason for m in rep.near_misses] == \
        ["scaled residual: FlashInfer fusion has no scale"]
    assert_fused_or_explained(make_block("hand", "funcol", True, False, 1e-6, scale=1.0),
                              *inputs, fused=1)
    assert_fused_or_explained(make_block("hand", "funcol", True, False, 1e-6), *inputs,
                              fused=1)


def test_cost_rule_on_flashinfer_devices(group, monkeypatch):
    """On FlashInfer's devices (widened to CPU here) a site is fused only when
    FlashInfer's fusion API is importable: without it the op's composite path was
    measured slower than plain Inductor on a GPU."""
    from commfold.ops import flashinfer_norm

    monkeypatch.setattr(flashinfer_norm, "DEVICE_TYPES", ("cuda", "cpu"))
    block = make_block("hand", "funcol", True, False, 1e-6)
    counts = {}
    for name, fi in (("without", lambda: None), ("with", object)):
        monkeypatch.setattr(flashinfer_norm, "flashinfer_comm", fi)
        g = post_grad(block, *_block_inputs(torch.bfloat16))
        commfold.CommfoldPass(commfold.Config(passes=(PASS,)))(g)
        rep = commfold.last_report()
        counts[name] = (rep.count(PASS), [m.reason.split(" (docs/")[0] for m in rep.near_misses])
    assert counts == {
        "without": (0, ["cost rule: on cpu without FlashInfer's fused all-reduce the op runs "
                        "its composite path (the all-reduce, then eager ops), measured slower "
                        "than plain Inductor (0.72x, H200, bf16, T=64, H=4096: "
                        "docs/gpu-check.md)"]),
        "with": (1, [])}, counts

