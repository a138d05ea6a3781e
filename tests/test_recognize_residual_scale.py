"""patterns.residual_scale (a scaled residual branch), vllm_ir.rms_norm after the
graph's own add (patterns.rmsnorm_vllm) and the near-miss rule (patterns.norm_reach)
on post-grad graphs, without ranks: each scale spelling gives its ResidualScale and
the norm after it, each op that stops the fusion is named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness.post_grad import assert_miss, node, nodes, placeholders, post_grad, vllm_ir_ops

from harness.models_norm import scale_branch
from commfold.patterns.common import aten
from commfold.torch_compat import torch_version
from commfold.patterns.norm_reach import HOPS, norm_path, unmatched_norm
from commfold.patterns.residual_scale import ResidualScale, match_residual_scale
from commfold.patterns.rmsnorm import RMSNorm, match_rmsnorm

T, H, EPS = 3, 16, 1e-6
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def _inputs(dtype=bf16):
    return (torch.randn(T, H, dtype=dtype), torch.randn(T, H, dtype=dtype),
            torch.randn(H, dtype=dtype))


def _rms(h, w):
    return F.rms_norm(h, (H,), w, EPS)


@pytest.mark.parametrize("dtype", [f32, bf16, f16], ids=["f32", "bf16", "fp16"])
@pytest.mark.parametrize("spelling,value,divides", [
    ("mul", 0.22, False), ("rmul", -3.7, False), ("div", 3.0, True), ("imul", 12.0, False)])
def test_scale_spellings(dtype, spelling, value, divides):
    """x * c, c * x, x / c and the in-place x *= c (of an intermediate: here -x)."""
    g = post_grad(lambda x, r, w: (lambda y: (_rms(r + y, w), r + y))(
        scale_branch(-x, value, spelling)), *_inputs(dtype))
    x = node(g, aten.neg.default)
    sc = match_residual_scale(x)
    op = aten.div.Tensor if divides else aten.mul.Tensor
    assert sc == ResidualScale(x, nodes(g, op)[0], value, divides) and not sc.identity
    norm = match_rmsnorm(sc.scaled)
    assert isinstance(norm, RMSNorm) and norm.x is sc.scaled
    assert norm.residual is placeholders(g)[1] and norm.weight is placeholders(g)[2]


@pytest.mark.parametrize("dtype", [f32, bf16], ids=["f32", "bf16"])
@pytest.mark.parametrize("spelling,divides", [("tensor", False), ("itensor", False),
                                              ("tdiv", True)])
def test_scale_by_a_0d_tensor(dtype, spelling, divides):
    """y * t, Gemma's y *= normalizer and y / t, t a 0-d tensor of y's dtype lifted as
    a graph input (as a module buffer is): the scale's value is the node."""
    t = torch.tensor(33.0**0.5, dtype=dtype)
    g = post_grad(lambda x, r, w, t: (lambda y: (_rms(r + y, w), r + y))(
        {"tensor": lambda: -x * t, "itensor": lambda: (-x).mul_(t),
         "tdiv": lambda: -x / t}[spelling]()), *_inputs(dtype), t)
    x, t_node = node(g, aten.neg.default), placeholders(g)[3]
    sc = match_residual_scale(x)
    op = aten.div.Tensor if divides else aten.mul.Tensor
    assert sc == ResidualScale(x, nodes(g, op)[0], t_node, divides)
    assert not sc.identity and not sc.number
    assert match_rmsnorm(sc.scaled).residual is placeholders(g)[1]


def test_a_0d_tensor_of_another_dtype_is_no_scale():
    """Inductor casts a 0-d f32 tensor to the bf16 value's dtype before it multiplies
    (eager ATen does not): no scale, a near-miss naming the multiply."""
    t = torch.tensor(0.22)
    g = post_grad(lambda x, r, w, t: _rms(r + x * t, w), *_inputs(bf16), t)
    x = placeholders(g)[0]
    assert match_residual_scale(x) is None
    assert_miss(unmatched_norm(x), "aten.mul.Tensor multiplies the all-reduce's "
                "torch.bfloat16 [3, 16] by a torch.float32 [] tensor: a scale is a number or a "
                "0-d tensor of the value's dtype", nodes(g, aten.mul.Tensor)[0])


def test_identity_and_not_a_scale():
    g = post_grad(lambda x, r, w: (x * 1, x * r, 2.0 / x, x.float() * 0.5), *_inputs())
    x = placeholders(g)[0]
    sc = match_residual_scale(x)
    if torch_version() >= (2, 14):  # its post-grad passes drop x * 1 before commfold's
        assert sc is None and not [n for n in nodes(g, aten.mul.Tensor) if n.args[1] == 1]
    else:  # torch 2.13: x * 1 (an int) stays in the graph: the identity
        assert sc.identity and sc.value == 1.0 and sc.scaled.args == (x, 1)
    g = post_grad(lambda x, r, w: (x * r, 2.0 / x, x.float() * 0.5, x * w[0].float()),
                  *_inputs())
    # a tensor, a reciprocal, an upcast, a 0-d tensor of another dtype
    assert match_residual_scale(placeholders(g)[0]) is None


def test_scaled_f32_sum_and_no_residual():
    """vLLM's fused add + norm of a scaled branch (the norm reads the f32 sum), and
    Granite's scaled embedding normed directly (no residual: m is the new residual)."""
    def vllm_fused(x, r, w):
        s = (x * 0.5).float() + r.float()
        n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
        return n.to(x.dtype) * w, s.to(x.dtype)

    g = post_grad(vllm_fused, *_inputs())
    norm = match_rmsnorm(match_residual_scale(placeholders(g)[0]).scaled)
    assert norm.sum_in_f32 and norm.residual is placeholders(g)[1]
    g = post_grad(lambda x, r, w: (_rms(m := x * 12.0, w), m), *_inputs())
    sc = match_residual_scale(placeholders(g)[0])
    norm = match_rmsnorm(sc.scaled)
    assert norm.residual is None and norm.h is sc.scaled


@pytest.mark.vllm(group="module")  # imports vLLM in this process
@pytest.mark.parametrize("w_dtype", [bf16, f32], ids=["w_bf16", "w_f32"])
def test_vllm_ir_rms_norm_of_the_graphs_sum(w_dtype):
    """vllm_ir.rms_norm(residual + x * c): the eager op reads the add's stored (rounded)
    output, so the norm does not read the f32 sum."""
    vllm_ir_ops()
    ir = torch.ops.vllm_ir

    def granite(x, r, w):
        h = r + x * 0.22
        return ir.rms_norm(h, w, EPS), h

    g = post_grad(granite, *_inputs(bf16)[:2], torch.randn(H, dtype=w_dtype))
    x, r, w = placeholders(g)
    sc = match_residual_scale(x)
    add, op = node(g, aten.add.Tensor), node(g, ir.rms_norm.default)
    assert match_rmsnorm(sc.scaled) == RMSNorm(sc.scaled, r, add, w, EPS, 0.0, False,
                                               w_dtype == bf16, bf16, op, (), eager=True)


# ------------------------------------------------------------------ the near-miss rule

def _miss(fn, reason, at, inputs=None):
    """match_rmsnorm finds nothing after the graph's first input; the rule names `at`."""
    g = post_grad(fn, *(inputs or _inputs()))
    x = placeholders(g)[0]
    assert match_rmsnorm(x) is None and match_residual_scale(x) is None or \
        match_rmsnorm(match_residual_scale(x).scaled) is None
    found = at(g)
    assert_miss(unmatched_norm(x), reason, found)


def test_the_op_in_the_way_is_named():
    """The op no spelling takes, and which of its properties failed."""
    _miss(lambda x, r, w: _rms(r + torch.tanh(x), w),
          "aten.tanh.default between all_reduce and rmsnorm: not a residual add, one scale "
          "by a constant or a float32 upcast", lambda g: node(g, aten.tanh.default))
    _miss(lambda x, r, w: _rms((x + r) * 0.5, w),  # the scale after the add
          "aten.mul.Tensor scales the sum after the residual add (a scale is fused only "
          "before the add)", lambda g: nodes(g, aten.mul.Tensor)[0])
    _miss(lambda x, r, w: _rms(x * 2.0 * 3.0 + r, w),  # a second scale
          "aten.mul.Tensor scales the all-reduce's value a second time (one scale is fused)",
          lambda g: nodes(g, aten.mul.Tensor)[1])
    _miss(lambda x, r, w: _rms(x + r + r, w),  # a second add
          "aten.add.Tensor is a second add after the residual add (one add is fused)",
          lambda g: nodes(g, aten.add.Tensor)[1])
    _miss(lambda x, r, w: _rms(x + w, w),  # a broadcast add repeating w: no residual
          "aten.add.Tensor broadcasts the all-reduce's [3, 16] against [16]: the other "
          "operand's elements would be repeated", lambda g: nodes(g, aten.add.Tensor)[0])
    _miss(lambda x, r, w: _rms(x + r.float(), w.float()),  # the residual in another dtype
          "aten.add.Tensor adds the all-reduce's torch.bfloat16 [3, 16] to a torch.float32 "
          "operand: dtypes differ (the fused op adds in the all-reduce's dtype)",
          lambda g: nodes(g, aten.add.Tensor)[0])
    _miss(lambda x, r, w: _rms(x.unsqueeze(1) + r, w)[0],  # [T, 1, H]: no leading 1
          "aten.unsqueeze.default views the all-reduce's [3, 16] as [3, 1, 16]: not only "
          "leading size-1 dims added or removed before a residual add",
          lambda g: node(g, aten.unsqueeze.default))


def test_a_norm_no_spelling_takes_names_its_first_op():
    def read_twice(x, r, w):  # the square is read besides the mean
        sq = x.pow(2)
        return x * torch.rsqrt(sq.mean(-1, keepdim=True) + EPS) * w, sq.sum()

    _miss(read_twice, "rmsnorm starting at aten.pow.Tensor_Scalar matched no spelling",
          lambda g: node(g, aten.pow.Tensor_Scalar), _inputs(f32))


def test_only_a_near_norm_is_a_near_miss():
    def chain(n):
        def fn(x, r, w):
            for op in (torch.sin, torch.cos, torch.exp, torch.neg, torch.sigmoid)[:n]:
                x = op(x)
            return _rms(x, w)
        return fn

    for n in range(HOPS + 2):
        g = post_grad(chain(n), *_inputs(f32))
        x = placeholders(g)[0]
        if n == 0:
            assert isinstance(match_rmsnorm(x), RMSNorm)
        else:
            assert (unmatched_norm(x) is not None) == (n <= HOPS), n
    g = post_grad(lambda x, r, w: _rms(x @ r.t() @ r, w), *_inputs(f32))  # a matmul: far
    assert norm_path(placeholders(g)[0]) is None and unmatched_norm(placeholders(g)[0]) is None
    g = post_grad(lambda x, r, w: (x + r).sum(-1), *_inputs(f32))  # no norm at all
    assert unmatched_norm(placeholders(g)[0]) is None
