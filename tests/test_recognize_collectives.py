"""patterns.allreduce and patterns.gather on post-grad graphs of a fake process group
(no ranks, milliseconds each): every spelling gives the typed match with the right
fields, every near-miss its reason. vLLM's spellings use vLLM's own ops (skipped
without vLLM, or without its shared-memory build for _C.shm_*)."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from harness.post_grad import (assert_miss, fake_world, node, nodes, placeholders, post_grad,
                       vllm_collectives, vllm_shm_ops)
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from commfold.patterns.allreduce import AllReduce, allreduce_candidates, match_allreduce
from commfold.patterns.common import aten, c10d
from commfold.patterns.gather import VocabGather, gather_candidates, match_vocab_gather

W, B, VS = 2, 4, 8
hop = torch.ops.higher_order
pytestmark = pytest.mark.filterwarnings("ignore:.*all_gather_tensor.*:FutureWarning")


@pytest.fixture(scope="module")
def group():
    with fake_world(W) as g:
        yield g


def _one(found):
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------ all-reduce

def _all_reduce(graph):
    return match_allreduce(_one(allreduce_candidates(graph)))


def test_funcol_all_reduce(group):
    g = post_grad(lambda x: funcol.all_reduce(x, "sum", group) * 2, torch.randn(B, VS))
    m = _all_reduce(g)
    coll, wait = node(g, c10d.all_reduce.default), node(g, c10d.wait_tensor.default)
    assert m == AllReduce(placeholders(g)[0], wait, "sum", f"c10d:{group.group_name}", coll,
                          (coll, wait))


def test_explicit_wait_and_avg(group):
    """A user's explicit wait adds a second wait_tensor: the last one holds the sum."""
    g = post_grad(lambda x: funcol.wait_tensor(funcol.all_reduce(x, "avg", group)) + 1,
                  torch.randn(B, VS))
    m = _all_reduce(g)
    waits = nodes(g, c10d.wait_tensor.default)
    assert len(waits) == 2 and m.reduced is waits[1] and m.reduce_op == "avg"
    assert m.comm_nodes == (m.collective, *waits)


def test_all_reduce_misses(group):
    g = post_grad(lambda x: funcol.all_reduce(x, "sum", group) * 2, torch.randn(B, VS))
    assert_miss(match_allreduce(node(g, aten.mul.Tensor)),
                "not an all-reduce spelling commfold knows")
    coll, wait = node(g, c10d.all_reduce.default), node(g, c10d.wait_tensor.default)
    wait.replace_all_uses_with(coll)
    g.erase_node(wait)
    assert_miss(match_allreduce(coll), "all-reduce without a wait_tensor", coll)


@pytest.mark.vllm(group="module")  # imports vLLM in this process
def test_vllm_all_reduce(group):
    vllm_collectives()
    g = post_grad(lambda x: torch.ops.vllm.all_reduce(x, "tp:0") + 1, torch.randn(B, VS))
    coll = node(g, torch.ops.vllm.all_reduce.default)
    assert _all_reduce(g) == AllReduce(placeholders(g)[0], coll, "sum", "vllm:tp:0", coll,
                                       (coll,))


def _shm_block(x):
    y = x * 2  # an intermediate: vLLM reduces a projection's output in place
    torch.ops._C.shm_allreduce(3, y)
    return y + 1


@pytest.mark.vllm(group="module")  # imports vLLM in this process
@pytest.mark.parametrize("v2", [False, True], ids=["auto_functionalized", "v2"])
def test_vllm_shm_all_reduce(group, v2):
    vllm_shm_ops()
    g = post_grad(_shm_block, torch.randn(B, VS), v2=v2)
    af = node(g, hop.auto_functionalized_v2 if v2 else hop.auto_functionalized)
    item = node(g, operator.getitem)
    assert item.args == (af, 1)
    assert _all_reduce(g) == AllReduce(node(g, aten.mul.Tensor), item, "sum", "vllm_shm:3",
                                       af, (af, item))


@pytest.mark.vllm(group="module")  # imports vLLM in this process
def test_vllm_shm_all_reduce_misses(group):
    vllm_shm_ops()
    g = post_grad(_shm_block, torch.randn(B, VS))
    af = node(g, hop.auto_functionalized)
    with g.inserting_after(af):
        again = g.call_function(operator.getitem, (af, 1))
    assert_miss(match_allreduce(af),
                "shm all-reduce result read other than through one getitem", af)
    g.erase_node(again)
    af.update_kwarg("handle", placeholders(g)[0])
    assert_miss(match_allreduce(af), "shm all-reduce handle is not a constant", af)

    def on_a_view(x):
        torch.ops._C.shm_allreduce(3, x[:2])  # a view: v2 passes the base and a slice
        return x + 1

    g = post_grad(on_a_view, torch.randn(B, VS), v2=True)
    af = node(g, hop.auto_functionalized_v2)
    assert_miss(match_allreduce(af),
                "shm all-reduce on a view of a larger tensor (auto_functionalized_v2)", af)


# ------------------------------------------------------------------ vocab gathers

def _gather(graph):
    return match_vocab_gather(_one(gather_candidates(graph)))


def _ag(x, group, dim=-1):
    return funcol.all_gather_tensor(x, dim, group)


def _fields(m: VocabGather, graph, gathered, waits=1):
    assert m.shard is placeholders(graph)[0] and m.world_size == W
    assert m.gathered is gathered
    assert m.comm_nodes == (m.collective, *m.waits) and len(m.waits) == waits


def test_funcol_split_cat(group):
    g = post_grad(lambda x: _ag(x, group).argmax(-1), torch.randn(B, VS))
    m = _gather(g)
    _fields(m, g, node(g, aten.cat.default))
    assert m.comm == f"c10d:{group.group_name}"
    assert m.collective is node(g, c10d.all_gather_into_tensor.default)


def test_dtensor_shard_to_replicate(group):
    mesh = DeviceMesh("cpu", list(range(W)))

    def fn(x):
        d = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return d.redistribute(mesh, [Replicate()]).to_local().argmax(-1)

    g = post_grad(fn, torch.randn(B, VS))
    _fields(_gather(g), g, node(g, aten.cat.default))


def _movedim(x, group):
    """In-place dist.all_gather_into_tensor + view/movedim, as a user writes it."""
    full = _ag(x, group, 0).view(W, *x.shape)
    return full.movedim(0, -2).reshape(*x.shape[:-1], W * x.shape[-1])


def test_reshape_permute_reshape(group):
    g = post_grad(lambda x: _movedim(x, group).argmax(-1), torch.randn(3, B, VS))
    reshapes = nodes(g, aten.reshape.default)
    assert node(g, aten.permute.default).args[1] == [1, 2, 0, 3]
    _fields(_gather(g), g, reshapes[-1])


def test_one_row_is_a_plain_reshape(group):
    g = post_grad(lambda x: _ag(x, group, 0).reshape(1, -1).argmax(-1), torch.randn(1, VS))
    _fields(_gather(g), g, node(g, aten.reshape.default))


@pytest.mark.vllm(group="module")  # imports vLLM in this process
def test_vllm_all_gather(group):
    vllm_collectives()
    g = post_grad(lambda x: torch.ops.vllm.all_gather(x, -1, W, "tp:0").argmax(-1),
                  torch.randn(B, VS))
    m = _gather(g)
    _fields(m, g, node(g, torch.ops.vllm.all_gather.default), waits=0)
    assert m.comm == "vllm:tp:0"


def _shm_gather(x):
    out = torch.empty(W * x.shape[0], x.shape[1])
    torch.ops._C.shm_all_gather(5, x, out)  # vLLM CPU's gather: rows, then re-laid
    full = out.reshape(W, *x.shape).permute(1, 0, 2).reshape(x.shape[0], -1)
    return full[:, :13].argmax(-1)


@pytest.mark.vllm(group="module")  # imports vLLM in this process
@pytest.mark.parametrize("v2", [False, True], ids=["auto_functionalized", "v2"])
def test_vllm_shm_all_gather(group, v2):
    vllm_shm_ops()
    g = post_grad(_shm_gather, torch.randn(B, VS), v2=v2)
    m = _gather(g)
    _fields(m, g, nodes(g, aten.reshape.default)[-1], waits=1)
    assert m.comm == "vllm_shm:5" and m.waits == (node(g, operator.getitem),)


def test_gather_misses_c10d(group):
    def check(fn, reason, x=None):
        g = post_grad(fn, torch.randn(B, VS) if x is None else x)
        coll = node(g, c10d.all_gather_into_tensor.default)
        assert_miss(match_vocab_gather(coll), reason, coll)

    check(lambda x: _ag(x, group, 0).argmax(-1), "gathered tensor is not a [rows..., vocab] "
          "tensor", torch.randn(VS))
    check(lambda x: ((f := _ag(x, group, 0)).argmax(-1), f.sum()),
          "the gathered buffer has several consumers")
    check(lambda x: _ag(x, group, 0).argmax(-1),
          "all-gather on dim 0 (rows), not re-laid on the vocab dim")
    check(lambda x: _ag(x, group, 0).reshape(-1).argmax(-1),
          "gathered buffer viewed other than as [world, *shard]")

    def chunks(x):
        return _ag(x, group, 0).split(B)

    check(lambda x: torch.cat([chunks(x)[0]] * 2, -1), "not every rank's chunk is used")
    check(lambda x: torch.cat(_ag(x, group, 0).split(VS // 2, 1), 0),
          "gathered buffer split other than into per-rank chunks")
    check(lambda x: (c := chunks(x))[0] + c[1], "per-rank chunks are not concatenated")
    check(lambda x: torch.cat(chunks(x)[::-1], -1),
          "per-rank chunks concatenated out of rank order")
    check(lambda x: (torch.cat(c := chunks(x), -1), c[1] * 2),
          "a per-rank chunk has another consumer")
    check(lambda x: _ag(x, group, 1), "gather on dim 1, not the last (vocab) dim",
          torch.randn(B, 3, VS))

    def viewed(x, perm, tail=None):
        full = _ag(x, group, 0).reshape(W, *x.shape).permute(*perm)
        return tail(full) if tail else full.reshape(x.shape[0], x.shape[1], -1)

    x3 = torch.randn(B, 3, VS)
    check(lambda x: viewed(x, (1, 0, 2, 3)), "rank dim is not moved next to the vocab dim",
          x3)
    check(lambda x: viewed(x, (1, 2, 0, 3), lambda f: f.sum(-1)),
          "rank and vocab dims are not merged", x3)
    check(lambda x: viewed(x, (1, 2, 0, 3), lambda f: f.reshape(-1)),
          "rank and vocab dims are not merged into one vocab dim", x3)

    g = post_grad(lambda x: _ag(x, group).argmax(-1), torch.randn(B, VS))
    coll, wait = node(g, c10d.all_gather_into_tensor.default), node(g, c10d.wait_tensor.default)
    wait.replace_all_uses_with(coll)
    g.erase_node(wait)
    assert_miss(match_vocab_gather(coll), "all-gather without a wait_tensor", coll)
    assert_miss(match_vocab_gather(node(g, aten.argmax.default)), "not an all-gather")


@pytest.mark.vllm(group="module")  # imports vLLM in this process
def test_gather_misses_vllm(group):
    vllm_collectives()
    g = post_grad(lambda x: torch.ops.vllm.all_gather(x, 0, W, "tp:0").argmax(-1),
                  torch.randn(B, VS))
    coll = node(g, torch.ops.vllm.all_gather.default)
    assert_miss(match_vocab_gather(coll), "all-gather on dim 0, not the last (vocab) dim", coll)


@pytest.mark.vllm(group="module")  # imports vLLM in this process
def test_gather_misses_shm(group):
    vllm_shm_ops()

    def check(fn, reason, x=None):
        g = post_grad(fn, torch.randn(B, VS) if x is None else x)
        af = node(g, hop.auto_functionalized)
        assert_miss(match_vocab_gather(af), reason, af)

    def gathered(x):
        out = torch.empty(W * x.shape[0], *x.shape[1:])
        torch.ops._C.shm_all_gather(5, x, out)
        return out

    check(lambda x: gathered(x).argmax(-1),
          "gathered tensor is not a [rows..., vocab] tensor", torch.randn(VS))
    check(lambda x: gathered(x).argmax(-1),
          "all-gather on dim 0 (rows), not re-laid on the vocab dim")
    g = post_grad(_shm_gather, torch.randn(B, VS))
    af = node(g, hop.auto_functionalized)
    with g.inserting_after(af):
        g.call_function(operator.getitem, (af, 1))  # a second reader of the buffer
    assert_miss(match_vocab_gather(af), "the gathered buffer has several consumers", af)
