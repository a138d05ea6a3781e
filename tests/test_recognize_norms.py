"""patterns.rmsnorm (aten spellings) and patterns.rmsnorm_vllm (vLLM's IR ops) on
post-grad graphs, without ranks (milliseconds each): every spelling of residual add +
RMSNorm gives an RMSNorm match that says how the graph rounds, every near-miss its
reason. The norm reads a graph input here; what produces it (an all-reduce) is
test_recognize_collectives.py's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness.post_grad import assert_miss, node, nodes, placeholders, post_grad, vllm_ir_ops

from commfold.patterns import rmsnorm
from commfold.patterns.common import aten, prims
from commfold.patterns.rmsnorm import RMSNorm, match_rmsnorm
from commfold.torch_compat import torch_version

T, H, EPS = 3, 16, 1e-6
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
hop = torch.ops.higher_order


def _inputs(dtype=f32, w_dtype=None):
    return (torch.randn(T, H, dtype=dtype), torch.randn(T, H, dtype=dtype),
            torch.randn(H, dtype=w_dtype or dtype))


def _norm(g):
    """match_rmsnorm on the graph's first input (the value normed)."""
    return match_rmsnorm(placeholders(g)[0])


def hand_written(x, r, w):
    h = x + r
    hf = h.float()
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
    return n.to(x.dtype) * w, h


def test_hand_written_f32():
    g = post_grad(hand_written, *_inputs())
    x, r, w = placeholders(g)
    add, out = nodes(g, aten.add.Tensor)[0], nodes(g, aten.mul.Tensor)[-1]
    m = _norm(g)
    assert m == RMSNorm(x, r, add, w, EPS, 0.0, False, False, f32, out, m.inner)
    assert {n.target for n in m.inner} == {aten.pow.Tensor_Scalar, aten.mean.dim,
                                          aten.add.Tensor, aten.rsqrt.default, aten.mul.Tensor}
    assert m.dtype == f32 and not m.sum_in_f32 and not m.eager


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "fp16"])
def test_hand_written_low_precision_rounds_before_the_weight(dtype):
    g = post_grad(hand_written, *_inputs(dtype))
    m = _norm(g)
    assert (m.round_before_weight, m.out_dtype, m.dtype) == (True, dtype, dtype)
    assert m.output is nodes(g, aten.mul.Tensor)[-1]
    assert any(n.target is prims.convert_element_type.default for n in m.inner)


@pytest.mark.parametrize("dtype", [f32, bf16], ids=["f32", "bf16"])
def test_f_rms_norm_multiplies_in_f32_and_casts_last(dtype):
    """F.rms_norm's own decomposition: add.Scalar with eps rounded to f32, positive dim."""
    g = post_grad(lambda x, r, w: F.rms_norm(x + r, (H,), w, EPS), *_inputs(dtype))
    m = _norm(g)
    assert m.eps == pytest.approx(EPS) and m.eps != EPS  # rounded to float32
    assert (m.round_before_weight, m.out_dtype, m.weight) == (False, dtype, placeholders(g)[2])
    assert m.output.target is (aten.mul.Tensor if dtype == f32
                               else prims.convert_element_type.default)


@pytest.mark.parametrize("in_weight_dtype", [False, True])
def test_gemma_offset(in_weight_dtype):
    def gemma(x, r, w):
        h = x + r
        hf = h.float()
        n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
        # (1 + w) in bf16, promoted by the multiply; or 1 + w computed in f32
        return (n * ((1.0 + w) if in_weight_dtype else 1.0 + w.float())).to(x.dtype)

    g = post_grad(gemma, *_inputs(bf16))
    m = _norm(g)
    assert (m.offset, m.offset_in_weight_dtype, m.weight) == (1.0, in_weight_dtype,
                                                              placeholders(g)[2])


def test_no_weight_no_residual_residual_first_and_x_times_x():
    def plain(x, r, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 0.25)

    g = post_grad(plain, *_inputs())
    m = _norm(g)
    x = placeholders(g)[0]
    assert (m.residual, m.h, m.weight, m.eps, m.round_before_weight) == (None, x, None, 0.25,
                                                                          False)
    g = post_grad(lambda x, r, w: hand_written(r, x, w), *_inputs())  # residual + x
    assert _norm(g).residual is placeholders(g)[1]


@pytest.mark.parametrize("residual_read", [True, False])
def test_vllm_f32_sum(residual_read):
    """vLLM's bf16 fused add + norm: the norm reads the exact f32 sum; the new residual
    is the sum rounded apart (absent when nothing reads it, e.g. the final norm)."""
    def fused(x, r, w):
        s = x.float() + r.float()
        n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
        out = n.to(x.dtype) * w
        return (out, s.to(x.dtype)) if residual_read else out

    g = post_grad(fused, *_inputs(bf16))
    m = _norm(g)
    assert m.sum_in_f32 and m.residual is placeholders(g)[1]
    casts = [c for c in nodes(g, prims.convert_element_type.default)
             if c.args[1] == bf16 and c.args[0].target is aten.add.Tensor]
    assert m.h is (casts[0] if residual_read else None)


def test_f32_residual_stream():
    """A residual stream kept in f32 (vLLM's f32-sum norm on torch < 2.13, whose cast
    back to bf16 torch drops, or a model that keeps its residual in f32): the fused op
    keeps the residual in the model's dtype, so no match, and the near-miss says why."""
    def norm(s):
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)

    def sum_read_on(x, r, w):  # the f32 sum is the next layer's residual as it is
        s = x.float() + r.float()
        return norm(s).to(x.dtype) * w, s

    def residual_in_f32(x, r32, w):
        s = x.float() + r32
        return norm(s).to(x.dtype) * w, s

    g = post_grad(sum_read_on, *_inputs(bf16))
    assert_miss(_norm(g), "the f32 sum is read outside the norm and never cast back to "
                "torch.bfloat16: a float32 residual stream (torch before 2.13 drops vLLM's "
                "cast back to the model's dtype, or the model keeps its residual in "
                "float32); the fused op keeps the residual in the model's dtype")
    x, _, w = _inputs(bf16)
    g = post_grad(residual_in_f32, x, torch.randn(T, H), w)
    assert_miss(_norm(g), "the residual is float32, not torch.bfloat16: a float32 residual "
                "stream (torch before 2.13 drops vLLM's cast back to the model's dtype, or "
                "the model keeps its residual in float32); the fused op keeps the residual "
                "in the model's dtype")


def test_no_norm_reads_x():
    g = post_grad(lambda x, r, w: (x + r).sum(-1), *_inputs())
    assert _norm(g) is None


def test_norm_misses():
    def check(fn, reason, inputs=None):
        g = post_grad(fn, *(inputs or _inputs()))
        assert_miss(_norm(g), reason)

    def norm(hf, mean=None, eps=EPS, rsqrt=torch.rsqrt):
        var = hf.pow(2).mean(-1, keepdim=True) if mean is None else mean(hf.pow(2))
        return hf * rsqrt(var + eps)

    def f32_sum(x, r, tail):
        s = x.float() + r.float()
        return tail(s, norm(s))

    low = _inputs(bf16)
    def upcast_read(x, r, w):
        xf = x.float()
        s = xf + r.float()
        return norm(s).to(x.dtype) * w, xf * 2

    check(upcast_read, "the upcast reduced value is read outside the norm", low)
    check(lambda x, r, w: f32_sum(x, r, lambda s, n: (n.to(x.dtype) * w, s.to(x.dtype),
                                                     s.to(x.dtype) + 1)),
          "the f32 sum is cast back more than once", low)
    check(lambda x, r, w: norm(x + r, lambda q: q.mean(0, keepdim=True)) * w,
          "norm over dims [0], not the last (hidden) dim")
    check(lambda x, r, w: (x + r) * (2 * (x + r).pow(2).mean(-1, keepdim=True)),
          "mean of squares not followed by + eps")
    check(lambda x, r, w: norm(x + r, eps=w[0]) * w, "eps is not a number")
    check(lambda x, r, w: norm(x + r, rsqrt=lambda v: torch.exp(-0.5 * torch.log(v))) * w,
          "variance + eps not followed by rsqrt")
    check(lambda x, r, w: x * torch.rsqrt((x + r).pow(2).mean(-1, keepdim=True) + EPS),
          "rsqrt does not scale the norm's input")
    check(lambda x, r, w: ((hf := (x + r).float()) * torch.rsqrt(
        hf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w + hf.sum(),
          "the upcast input is read outside the norm", low)
    check(lambda x, r, w: norm(x + r) * w.reshape(1, H),
          "norm weight is not a [hidden] vector")
    check(lambda x, r, w: norm(x + r) * w, "norm weight in unsupported dtype torch.float64",
          _inputs(f32, torch.float64))

    g = post_grad(lambda x, r, w: norm(x + r) * w, *_inputs())
    node(g, aten.mean.dim).update_kwarg("dtype", torch.float64)
    assert_miss(_norm(g), "mean of squares in a dtype other than float32")
    # every intermediate is checked single-reader on the way (reasons above); the
    # final check guards the set as a whole: the tail matcher with a read one
    g = post_grad(lambda x, r, w: norm(x + r) * w, *_inputs())
    mean = node(g, aten.mean.dim)
    with g.inserting_after(mean):
        g.call_function(aten.neg.default, (mean,))
    x, r, _ = placeholders(g)
    inner = [node(g, aten.pow.Tensor_Scalar), mean, nodes(g, aten.add.Tensor)[1],
             node(g, aten.rsqrt.default)]
    assert_miss(rmsnorm._match_tail(x, r, nodes(g, aten.add.Tensor)[0], EPS,
                                    nodes(g, aten.mul.Tensor)[0], inner, f32),
                "an intermediate of the norm is read outside it", mean)
    g = post_grad(lambda x, r, w: norm(x + r) * w, *_inputs())
    out = nodes(g, aten.mul.Tensor)[-1]  # no dtype promotion spells this: set it
    out.meta["val"] = out.meta["val"].to(f16)
    assert_miss(_norm(g), "norm output in torch.float16 (neither f32 nor the input dtype)", out)


def test_reciprocal_sqrt_by_torch_version():
    """`1 / v.sqrt()` is an RMSNorm from torch 2.14 on, whose post-grad passes rewrite
    reciprocal(sqrt(x)) to rsqrt(x) (reciprocal_sqrt_to_rsqrt) before commfold's pass;
    torch 2.11-2.13 leave the division, which the recognizer does not take as rsqrt."""
    g = post_grad(lambda x, r, w: (s := x + r) * (1 / (s.pow(2).mean(-1, keepdim=True)
                                                     + EPS).sqrt()) * w, *_inputs())
    if torch_version() >= (2, 14):
        assert isinstance(_norm(g), RMSNorm) and node(g, aten.rsqrt.default)
    else:
        assert_miss(_norm(g), "variance + eps not followed by rsqrt")


# ------------------------------------------------------------------ vLLM IR ops

@pytest.fixture
def ir():
    vllm_ir_ops()
    return torch.ops.vllm_ir


@pytest.mark.vllm(group="module")  # imports vLLM in this process
@pytest.mark.parametrize("w_dtype", [bf16, f32], ids=["w_bf16", "w_f32"])
def test_vllm_ir_rms_norm(ir, w_dtype):
    g = post_grad(lambda x, r, w: ir.rms_norm(x, w, EPS), *_inputs(bf16, w_dtype))
    x, _, w = placeholders(g)
    op = node(g, ir.rms_norm.default)
    assert _norm(g) == RMSNorm(x, None, x, w, EPS, 0.0, False, w_dtype == bf16, bf16, op, (),
                               sum_in_f32=True, eager=True)


@pytest.mark.vllm(group="module")  # imports vLLM in this process
@pytest.mark.parametrize("v2", [False, True], ids=["auto_functionalized", "v2"])
@pytest.mark.parametrize("residual_read", [True, False])
def test_vllm_ir_fused_add_rms_norm(ir, v2, residual_read):
    def fused(x, r, w):
        y = x * 1  # the op writes its inputs: not graph inputs here
        res = r * 1
        out, new_res = ir.fused_add_rms_norm.maybe_inplace(y, res, w, EPS, None)
        return (out, new_res) if residual_read else out

    g = post_grad(fused, *_inputs(bf16), v2=v2)
    af = node(g, hop.auto_functionalized_v2 if v2 else hop.auto_functionalized)
    y, res = nodes(g, aten.mul.Tensor)
    items = {i.args[1]: i for i in af.users}
    m = match_rmsnorm(y)
    assert (m.x, m.residual, m.output, m.h) == (y, res, items[0], items.get(1))
    assert m.sum_in_f32 and m.eager and m.inner[0] is af
    assert match_rmsnorm(res) == m.__class__(**{**m.__dict__, "x": res, "residual": y})


@pytest.mark.vllm(group="module")  # imports vLLM in this process
def test_vllm_ir_misses(ir):
    def fused(x, r, w, eps=EPS, variance_size=None, tail=None):
        y, res = x * 1, r * 1
        out = ir.fused_add_rms_norm.maybe_inplace(y, res, w, eps, variance_size)
        return tail(out, y) if tail else out

    def check(fn, reason, inputs=None, v2=False):
        g = post_grad(fn, *(inputs or _inputs(bf16)), v2=v2)
        assert_miss(match_rmsnorm(nodes(g, aten.mul.Tensor)[0]), reason)
        return g

    def viewed(x, r, w):
        y, res = x * 1, r * 1
        return ir.fused_add_rms_norm.maybe_inplace(y[:2], res[:2], w, EPS, None)

    check(viewed, "vllm_ir.fused_add_rms_norm on a view of a mutated base", v2=True)
    check(fused, "vllm_ir.fused_add_rms_norm operands differ in shape or dtype",
          (torch.randn(T, H, dtype=bf16), torch.randn(T, H), torch.randn(H, dtype=bf16)))
    check(lambda x, r, w: fused(x, r, w, tail=lambda out, y: (*out, y)),
          "vllm_ir.fused_add_rms_norm's in-place inputs are read after it")
    check(lambda x, r, w: fused(x, r, w, variance_size=8),
          "vllm_ir norm with variance_size (a partial-row variance)")
    check(fused, "norm weight is not a [hidden] vector",
          (*_inputs(bf16)[:2], torch.randn(2 * H, dtype=bf16)[:H].reshape(1, H)))
    check(fused,
          "vllm_ir norm weight dtype torch.float16 differs from the input's torch.bfloat16",
          _inputs(bf16, f16))
    g = post_grad(fused, *_inputs(bf16))
    af = node(g, hop.auto_functionalized)
    af.update_kwarg("epsilon", placeholders(g)[0])
    assert_miss(match_rmsnorm(nodes(g, aten.mul.Tensor)[0]), "vllm_ir norm eps is not a number")
    with g.inserting_after(af):
        g.call_function(list, (af,))
    assert_miss(match_rmsnorm(nodes(g, aten.mul.Tensor)[0]),
                "vllm_ir.fused_add_rms_norm result read other than by getitem")

