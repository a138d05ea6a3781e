"""A residual add that broadcasts the reduced value against the residual stream
(patterns.broadcast), on post-grad graphs without ranks: when only leading size-1
dims differ ([T, H] + [1, T, H], a hook's all-reduced ``output[0]``) the norm matches
and the pass fuses it with the add's output shape; a broadcast that repeats elements
is a near-miss saying whose. The numerics are test_fuse_broadcast_residual.py's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from harness.post_grad import assert_miss, fake_world, node, placeholders, post_grad

import commfold
from commfold.patterns.broadcast import leading_ones_only
from commfold.patterns.common import aten, c10d
from commfold.patterns.norm_reach import unmatched_norm
from commfold.patterns.rmsnorm import RMSNorm, match_rmsnorm

T, H, EPS = 3, 16, 1e-6
AF = torch.ops.higher_order.auto_functionalized


def _norm_of_sum(res_first):
    def fn(x, r, w):
        h = r + x if res_first else x + r
        return F.rms_norm(h, (H,), w, EPS), h
    return fn


@pytest.mark.parametrize("res_first", [True, False], ids=["residual+x", "x+residual"])
@pytest.mark.parametrize("x_shape,r_shape", [((T, H), (1, T, H)), ((1, T, H), (T, H)),
                                             ((T, H), (1, 1, T, H))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_leading_ones_are_a_residual_add(res_first, x_shape, r_shape, dtype):
    g = post_grad(_norm_of_sum(res_first), torch.randn(x_shape, dtype=dtype),
                  torch.randn(r_shape, dtype=dtype), torch.randn(H, dtype=dtype))
    x, r, w = placeholders(g)
    m = match_rmsnorm(x)
    assert isinstance(m, RMSNorm), m
    assert (m.x, m.residual, m.h, m.weight) == (x, r, node(g, aten.add.Tensor), w)


@pytest.mark.parametrize("view", ["unsqueeze", "view", "squeeze"])
def test_a_leading_one_view_before_the_add(view):
    """out.unsqueeze(0) + residual, out.view(1, T, H) + residual (post-grad: a
    reshape), out.squeeze(0) + residual: the match carries the view, read only by the
    add; a view read elsewhere too is no residual add's operand."""
    def fn(x, r, w):
        y = {"unsqueeze": lambda: x.unsqueeze(0), "view": lambda: x.view(1, T, H),
             "squeeze": lambda: x.squeeze(0)}[view]()
        return _norm_of_sum(True)(y, r, w)

    x_shape = (1, T, H) if view == "squeeze" else (T, H)
    g = post_grad(fn, torch.randn(x_shape), torch.randn(1, T, H), torch.randn(H))
    x, r, _ = placeholders(g)
    m = match_rmsnorm(x)
    assert isinstance(m, RMSNorm) and (m.x, m.residual) == (x, r), m
    assert m.x_view is not None and m.x_view.args[0] is x and list(m.x_view.users) == [m.h]


@pytest.mark.parametrize("x_shape,r_shape,reason", [
    ((T, H), (2, T, H), "aten.add.Tensor broadcasts the all-reduce's [3, 16] against "
                        "[2, 3, 16]: its elements would be repeated"),
    ((1, H), (T, H), "aten.add.Tensor broadcasts the all-reduce's [1, 16] against "
                     "[3, 16]: its elements would be repeated"),
    ((T, 1, H), (T, 2, H), "aten.add.Tensor broadcasts the all-reduce's [3, 1, 16] against "
                           "[3, 2, 16]: its elements would be repeated"),
    ((T, H), (1, H), "aten.add.Tensor broadcasts the all-reduce's [3, 16] against "
                     "[1, 16]: the other operand's elements would be repeated"),
    ((2, 1, H), (1, T, H), "aten.add.Tensor broadcasts the all-reduce's [2, 1, 16] against "
                           "[1, 3, 16]: both operands' elements would be repeated")])
def test_a_repeating_broadcast_is_named(x_shape, r_shape, reason):
    g = post_grad(_norm_of_sum(True), torch.randn(x_shape), torch.randn(r_shape),
                  torch.randn(H))
    x = placeholders(g)[0]
    assert match_rmsnorm(x) is None
    assert_miss(unmatched_norm(x), reason, node(g, aten.add.Tensor))


def test_leading_ones_only():
    assert leading_ones_only([1, 3, 16], [3, 16]) and leading_ones_only([3, 16], [3, 16])
    assert leading_ones_only([1, 1, 16], [16]) and leading_ones_only([1, 16], [1, 1, 16])
    assert not leading_ones_only([3, 16], [2, 3, 16]) and not leading_ones_only([3, 1], [3, 16])
    assert not leading_ones_only([3, 1, 16], [3, 16])  # an inner 1 is no leading one


@pytest.fixture(scope="module")
def group():
    with fake_world(2) as g:
        yield g


def _fuse(g):
    """The fusion alone on post-grad graph g (strict, no cost rule): its report."""
    commfold.CommfoldPass(commfold.Config(passes=("fuse_allreduce_rmsnorm",), strict=True,
                                          fuse_cost_rule=False))(g)
    return commfold.last_report()


def _hook_block(r_shape, res_first, view=False):
    def fn(x, m, r, w):
        # the hook's dist.all_reduce(output[0]), as Dynamo traces it
        out = funcol.all_reduce(x @ m, "sum", dist.group.WORLD)
        out = out.unsqueeze(0) if view else out
        h = r + out if res_first else out + r
        return F.rms_norm(h, (H,), w, EPS), h
    return fn, (torch.randn(T, 8), torch.randn(8, H), torch.randn(r_shape), torch.randn(H))


@pytest.mark.parametrize("view", [False, True], ids=["", "unsqueeze"])
@pytest.mark.parametrize("res_first", [True, False], ids=["residual+x", "x+residual"])
def test_pass_fuses_with_the_adds_shape(group, res_first, view):
    fn, inputs = _hook_block((1, T, H), res_first, view)
    g = post_grad(fn, *inputs)
    add = node(g, aten.add.Tensor)
    want = add.meta["val"].shape
    rep = _fuse(g)
    assert rep.count("fuse_allreduce_rmsnorm") == 1 and not rep.near_misses, rep.summary()
    fused = node(g, AF)
    assert fused.kwargs["x"].target is aten.unsqueeze.default  # a view, not a copy
    assert fused.kwargs["residual"] is placeholders(g)[2]
    assert all(u.meta["val"].shape == want for u in fused.users)
    assert "leading-1 broadcast" in rep.rewrites[0].detail
    assert not [n for n in g.nodes if n.target is c10d.all_reduce.default]  # the op runs it
    # the graph's view went with the add: one unsqueeze left, the op's own
    assert [n.target for n in g.nodes if n.op == "call_function"].count(
        aten.unsqueeze.default) == 1


def test_pass_skips_a_view_read_besides_the_add(group):
    def fn(x, m, r, w):
        y = funcol.all_reduce(x @ m, "sum", dist.group.WORLD).unsqueeze(0)
        return F.rms_norm(y + r, (H,), w, EPS), y * 2

    g = post_grad(fn, torch.randn(T, 8), torch.randn(8, H), torch.randn(1, T, H),
                  torch.randn(H))
    rep = _fuse(g)
    assert rep.count("fuse_allreduce_rmsnorm") == 0
    assert [m.reason for m in rep.near_misses] == [
        "the reduced value is read besides the residual add (the op returns only the sum "
        "with the residual)"]


def test_pass_refuses_a_repeating_broadcast(group):
    fn, inputs = _hook_block((2, T, H), True)
    g = post_grad(fn, *inputs)
    rep = _fuse(g)
    assert rep.count("fuse_allreduce_rmsnorm") == 0
    assert [m.reason for m in rep.near_misses] == [
        "aten.add.Tensor broadcasts the all-reduce's [3, 16] against [2, 3, 16]: its "
        "elements would be repeated"]
