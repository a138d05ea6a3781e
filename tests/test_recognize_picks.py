"""What reads a gathered row of vocab-sharded logits, on post-grad graphs of a fake
process group (no ranks, milliseconds each): greedy picks (patterns.greedy), top-k
(patterns.topk) and softmax statistics (patterns.softmax_stats) give their typed
matches with the right fields, and every near-miss its reason. The gather is funcol's
(its other spellings: test_recognize_collectives.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from harness.post_grad import assert_miss, fake_world, node, nodes, placeholders, post_grad
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from commfold.patterns.common import aten, c10d, prims
from commfold.patterns.gather import match_vocab_gather
from commfold.patterns.greedy import GreedyPick, match_greedy
from commfold.patterns.softmax_stats import match_row_reads
from commfold.patterns.topk import match_topk

W, B, VS = 2, 4, 8
pytestmark = pytest.mark.filterwarnings("ignore:.*all_gather_tensor.*:FutureWarning")


@pytest.fixture(scope="module")
def group():
    with fake_world(W) as g:
        yield g


def _trace(group, read, x=None, *extra):
    """The graph of read(gathered logits, *extra) and its VocabGather."""
    x = torch.randn(B, VS) if x is None else x
    g = post_grad(lambda s, *e: read(funcol.all_gather_tensor(s, -1, group), *e), x, *extra)
    gather = match_vocab_gather(node(g, c10d.all_gather_into_tensor.default))
    assert gather, gather
    return g, gather


def _surgery_tuple_user(g, target):
    """A reader of a tuple-returning op's result other than a getitem."""
    op = node(g, target)
    with g.inserting_after(op):
        g.call_function(list, (op,))
    return op


# ------------------------------------------------------------------ greedy picks

def test_argmax(group):
    g, gather = _trace(group, lambda f: f.argmax(-1))
    assert match_greedy(gather) == GreedyPick(gather, None, (), node(g, aten.argmax.default),
                                              "argmax", False)


def test_max_values_and_indices_keepdim(group):
    g, gather = _trace(group, lambda f: f.max(-1, keepdim=True))
    m = match_greedy(gather)
    assert (m.kind, m.keepdim, m.pick) == ("max", True, node(g, aten.max.dim))


def test_topk_1_is_a_greedy_pick(group):
    g, gather = _trace(group, lambda f: f.topk(1))
    m = match_greedy(gather)
    assert (m.kind, m.keepdim, m.pick) == ("topk", True, node(g, aten.topk.default))
    assert match_topk(gather) is None  # not the top-k recognizer's


def test_slice_to_valid_vocab_and_monotone_ops(group):
    """Padding sliced off, then a temperature, a soft-cap and a float cast (bf16)."""
    g, gather = _trace(group, lambda f: (torch.tanh(f[:, :13] / 0.7) * 30.0).float()
                       .argmax(-1, keepdim=True), torch.randn(B, VS, dtype=torch.bfloat16))
    m = match_greedy(gather)
    assert m.valid_vocab == 13 and m.keepdim and m.kind == "argmax"
    assert [op.target for op in m.elementwise] == [
        aten.div.Tensor, aten.tanh.default, aten.mul.Tensor, prims.convert_element_type.default]


def test_symbolic_valid_vocab(group):
    """A slice end that is a run-time symbol (a dynamic vocab size): the node itself."""
    g, gather = _trace(group, lambda f: f[:, :13].argmax(-1))
    end = g.placeholder("vocab")
    end.meta["val"] = ShapeEnv().create_unbacked_symint()
    node(g, aten.slice.Tensor).update_arg(3, end)
    assert match_greedy(gather).valid_vocab is end


def test_nothing_argmax_like_reads_the_row(group):
    _, gather = _trace(group, lambda f: f.sum(-1))
    assert match_greedy(gather) is None


def test_greedy_misses(group):
    def check(read, reason, x=None, *extra):
        g, gather = _trace(group, read, x, *extra)
        assert_miss(match_greedy(gather), reason)

    t = torch.tensor(0.5)
    check(lambda f, t: (t / f).argmax(-1), "logits are a divisor (order-reversing)", None, t)
    check(lambda f: (2.0 / f).argmax(-1), "reciprocal.default between the gather and the "
          "argmax is not a known monotone elementwise op")  # post-grad: reciprocal(f) * 2
    check(lambda f, t: (f / t).argmax(-1),
          "scaled by a tensor whose sign is unknown at compile time", None, t)
    check(lambda f: (f * -2.0).argmax(-1), "scaled by a non-positive number (order-reversing)")
    check(lambda f: (1.0 - f).argmax(-1), "logits are subtracted (order-reversing)")
    check(lambda f, b: (f + b).argmax(-1), "a tensor is added (may vary along the vocab dim)",
          None, torch.randn(W * VS))
    check(lambda f: (-f).argmax(-1), "negation (order-reversing)")
    check(lambda f: f.abs().argmax(-1),
          "abs.default between the gather and the argmax is not a known monotone "
          "elementwise op")
    check(lambda f: (f.argmax(-1), f.sum(-1)), "the gathered logits have other consumers")
    check(lambda f: f.cumsum(-1).argmax(-1), "an unsupported op between the gather and the "
          "argmax")
    check(lambda f: f[:2].argmax(-1), "slice on a dim other than vocab")
    check(lambda f: f[:, 1:].argmax(-1), "slice of the vocab dim other than [0:V]")
    check(lambda f: f[:, :-3].argmax(-1), "slice of the vocab dim with a non-positive end")
    check(lambda f: f.argmax(-1), "argmax over torch.int64 logits (floating point only)",
          torch.arange(B * VS).reshape(B, VS))
    check(lambda f: f.argmax(), "argmax over the flattened tensor")
    check(lambda f: f.argmax(1), "argmax over dim 1, not the vocab dim",
          torch.randn(B, 3, VS))
    check(lambda f: f.topk(1, largest=False), "topk(largest=False)")

    g, gather = _trace(group, lambda f: (f + 1.0).argmax(-1))
    node(g, aten.add.Tensor).update_kwarg("alpha", 2)
    assert_miss(match_greedy(gather), "add/sub with alpha")
    for read, target, reason in [(lambda f: f.max(-1), aten.max.dim, "max() result used as "
                                  "a tuple"),
                                 (lambda f: f.topk(1), aten.topk.default, "topk() result "
                                  "used as a tuple")]:
        g, gather = _trace(group, read)
        op = _surgery_tuple_user(g, target)
        assert_miss(match_greedy(gather), reason, op)


def test_a_dead_shape_query_is_not_a_reader(group):
    """torch 2.11-2.12 leave a dead ``sym_size`` of a DTensor's gathered logits in the
    post-grad graph (2.13 drops it): a second consumer to the recognizer, so commfold's
    manager erases dead shape queries before any pass runs."""
    import commfold

    g, gather = _trace(group, lambda f: f.topk(1))
    with g.inserting_after(gather.gathered):
        g.call_function(aten.sym_size.int, (gather.gathered, 1))
    assert_miss(match_greedy(gather), "the gathered logits have other consumers")
    commfold.CommfoldPass(commfold.Config(passes=()))(g)
    assert not nodes(g, aten.sym_size.int)
    assert match_greedy(gather).kind == "topk"


# ------------------------------------------------------------------ top-k

def test_topk(group):
    g, gather = _trace(group, lambda f: f[:, :13].topk(4))
    m = match_topk(gather)
    topk = node(g, aten.topk.default)
    assert (m.kind, m.k, m.valid_vocab, m.reader, m.elementwise) == ("topk", 4, 13, topk, ())
    assert dict(m.outputs) == {i: i.args[1] for i in topk.users} and len(m.outputs) == 2


@pytest.mark.parametrize("stable", [False, True])
def test_descending_sort_read_through_its_first_k(group, stable):
    def read(f):
        if stable:
            return tuple(t[:, :5] for t in torch.sort(f, dim=-1, descending=True, stable=True))
        return tuple(t[:, :5] for t in f.sort(-1, descending=True))

    g, gather = _trace(group, read)
    m = match_topk(gather)
    slices = nodes(g, aten.slice.Tensor)
    assert (m.kind, m.k, m.reader.target) == (
        "sort", 5, aten.sort.stable if stable else aten.sort.default)
    assert {o: which for o, which in m.outputs} == {s: s.args[0].args[1] for s in slices}


def test_a_narrow_row_sorted_whole_is_its_top_k(group):
    """A descending sort of a row of 2 * 8 = 16 <= 64 columns, used whole: its top 16."""
    g, gather = _trace(group, lambda f: f.sort(-1, descending=True)[0] * 2)
    m = match_topk(gather)
    sort = node(g, aten.sort.default)
    assert (m.kind, m.k) == ("sort", 16)
    assert m.outputs == ((next(iter(sort.users)), 0),)


def test_topk_misses(group):
    wide = torch.randn(B, 40)

    def check(read, reason, x=None):
        _, gather = _trace(group, read, x)
        assert_miss(match_topk(gather), reason)

    check(lambda f: f.topk(3), "top-k over torch.int64 logits (floating point only)",
          torch.arange(B * VS).reshape(B, VS))
    check(lambda f: f.topk(65), "top-k with k > 64 (the gathered pairs would not be small)",
          wide)
    check(lambda f: f.topk(2, dim=1), "topk over a dim other than vocab",
          torch.randn(B, 3, VS))
    check(lambda f: f.topk(2, largest=False), "topk(largest=False) (smallest k: not supported)")
    check(lambda f: f.sort(1, descending=True)[0][:, :, :2], "sort over a dim other than vocab",
          torch.randn(B, 3, VS))
    check(lambda f: f.sort(-1)[0][:, :2], "ascending sort (smallest first: not supported)")
    check(lambda f: f.sort(-1, descending=True)[0].cumsum(-1),
          "sorted logits used beyond a slice of the first k (the full sorted row is needed)",
          wide)
    check(lambda f: ((s := f.sort(-1, descending=True))[0][:, :4], s[1][:, :5]),
          "sort outputs sliced to different lengths", wide)
    check(lambda f: f.sort(-1, descending=True)[1][:, :1], "sort sliced to fewer than 2 entries",
          wide)

    g, gather = _trace(group, lambda f: f.topk(3))
    node(g, aten.topk.default).update_arg(1, placeholders(g)[0])
    assert_miss(match_topk(gather), "top-k with a k not known at compile time")
    for read, target, reason in [
            (lambda f: f.topk(3), aten.topk.default, "topk() result used as a tuple"),
            (lambda f: f.sort(-1, descending=True)[0][:, :3], aten.sort.default,
             "sort() result used as a tuple")]:
        g, gather = _trace(group, read)
        _surgery_tuple_user(g, target)
        assert_miss(match_topk(gather), reason)


# ------------------------------------------------------------------ softmax statistics

def test_log_softmax_at_chosen_tokens_and_greedy_pick(group):
    def read(f, idx):
        row = f[:, :13]
        return torch.log_softmax(row.float(), -1).gather(-1, idx), row.argmax(-1)

    g, gather = _trace(group, read, torch.randn(B, VS, dtype=torch.bfloat16),
                       torch.zeros(B, 2, dtype=torch.int64))
    m = match_row_reads(gather)
    s, = m.stats
    assert m.valid_vocab == 13 and m.gather is gather
    assert [op.target for op in s.chain] == [prims.convert_element_type.default]
    assert s.amax is node(g, aten.amax.default) and s.exp is node(g, aten.exp.default)
    assert s.sum is node(g, aten.sum.dim_IntList) and s.log is node(g, aten.log.default)
    assert s.picks == (node(g, aten.gather.default),) and s.finite_shift is None
    assert s.softmax_max == ()
    gr, = m.greedy
    assert gr.pick is node(g, aten.argmax.default) and gr.chain == ()


def test_logsumexp(group):
    g, gather = _trace(group, lambda f: torch.logsumexp(f, -1))
    s, = match_row_reads(gather).stats
    assert s.finite_shift is node(g, aten.where.self) and s.picks == () and s.log is not None


@pytest.mark.parametrize("pick", ["max", "argmax"])
def test_softmax_top_probability(group, pick):
    target = aten.max.dim if pick == "max" else aten.argmax.default
    g, gather = _trace(group, lambda f: getattr(torch.softmax(f, -1), pick)(-1))
    s, = match_row_reads(gather).stats
    assert s.softmax_max == (node(g, target),) and s.log is None


def _online(g):
    """Inductor's online softmax on CUDA, by hand (its post-grad pattern
    prepare_softmax_pattern -> prepare_softmax_replacement runs on CUDA / XPU only):
    P = prepare_softmax_online(X, -1) stands for amax (P[0]) and the keepdim sum of
    exp(X - amax) (P[1]); an exp nothing else reads is gone."""
    import operator

    from torch._inductor import inductor_prims

    amax, total = node(g, aten.amax.default), node(g, aten.sum.dim_IntList)
    with g.inserting_before(amax):
        p = g.call_function(inductor_prims.prepare_softmax_online, (amax.args[0], -1))
        a, s = (g.call_function(operator.getitem, (p, i)) for i in (0, 1))
    p.meta["val"] = (amax.meta["val"], total.meta["val"])
    a.meta["val"], s.meta["val"] = amax.meta["val"], total.meta["val"]
    amax.replace_all_uses_with(a)
    total.replace_all_uses_with(s)
    exp = total.args[0]
    g.erase_node(total)
    g.erase_node(amax)
    if not exp.users:
        g.erase_node(exp)
    return p, a, s


def test_online_softmax_form(group):
    """CUDA graphs (Inductor's online softmax): the same statistics from
    prepare_softmax_online's max and sum; log_softmax's exp then has no node."""
    g, gather = _trace(group, lambda f, i: torch.log_softmax(f, -1).gather(-1, i), None,
                       torch.zeros(B, 2, dtype=torch.int64))
    p, a, total = _online(g)
    s, = match_row_reads(gather).stats
    assert (s.online, s.amax, s.sum, s.exp) == (p, a, total, None) and s.sum_keepdim
    assert s.picks == (node(g, aten.gather.default),) and s.log is node(g, aten.log.default)

    g, gather = _trace(group, lambda f: torch.softmax(f, -1).max(-1))
    p, a, total = _online(g)
    s, = match_row_reads(gather).stats
    assert s.online is p and s.exp is node(g, aten.exp.default)
    assert s.softmax_max == (node(g, aten.max.dim),)

    g, gather = _trace(group, lambda f: torch.logsumexp(f, -1))
    p, _, _ = _online(g)  # (not a form Inductor makes: logsumexp's shift is guarded)
    with g.inserting_after(p):
        g.call_function(list, (p,))
    assert_miss(match_row_reads(gather), "prepare_softmax_online's outputs are read other "
                "than as max and sum")


def test_online_softmax_form_is_rewritten(group):
    """local_softmax_stats on the online form: the op replaces P's max and sum, and
    the gather, prepare_softmax_online and the row-sized nodes are gone. (Its results
    on CUDA: tools/gpu_check.sh, passes: vocab_program.)"""
    import commfold

    g, _ = _trace(group, lambda f, i: torch.log_softmax(f, -1).gather(-1, i), None,
                  torch.zeros(B, 2, dtype=torch.int64))
    p, _, _ = _online(g)
    commfold.CommfoldPass(commfold.Config(passes=("local_softmax_stats",), strict=True))(g)
    assert commfold.last_report().count("local_softmax_stats") == 1
    assert p._erased and not nodes(g, c10d.all_gather_into_tensor.default)
    vals = [n.meta.get("val") for n in g.nodes if n.op == "call_function"]
    assert not any(isinstance(v, torch.Tensor) and v.dim() and v.shape[-1] == W * VS
                   for v in vals)  # nothing row-sized left


def test_no_amax_is_not_this_pattern(group):
    _, gather = _trace(group, lambda f: f.argmax(-1))
    assert match_row_reads(gather) is None


def test_softmax_stats_misses(group):
    def check(read, reason, x=None, *extra):
        _, gather = _trace(group, read, x, *extra)
        assert_miss(match_row_reads(gather), reason)

    def shifted(f):
        return f - f.amax(-1, keepdim=True)

    check(lambda f: (torch.logsumexp(f, -1), f.cumsum(-1)),
          "the gathered row has a consumer that needs the full row (cumsum)")
    check(lambda f: shifted(f).exp().sum(-1) + torch.where(
        (a := f.amax(-1, keepdim=True)) > 0, a, 0.0).sum(), "amax is post-processed in an "
          "unknown way")
    check(lambda f: f.amax(-1, keepdim=True) * 2, "amax of the row is used other than as "
          "the softmax shift")
    check(lambda f: torch.softmax(f * 0.5, -1).max(-1),
          "softmax of a scaled row in Inductor's guarded form (where(all finite, (x - max x) "
          "* c, ...)): not supported yet")
    check(lambda f: shifted(f).abs(), "shifted row is not exponentiated")
    check(lambda f: shifted(f).exp(), "exp of the shifted row is not summed over the vocab dim")
    check(lambda f: ((d := shifted(f)).exp().sum(-1), d * 2),
          "the shifted row feeds mul, which needs the full row")
    check(lambda f: ((e := shifted(f).exp()).sum(-1), e * 2),
          "exp of the shifted row feeds mul, which needs the full row")
    check(lambda f: torch.softmax(f, -1), "softmax row feeds output, which needs the full row")
    check(lambda f: torch.log_softmax(f, -1), "log_softmax row feeds output, which needs the "
          "full row")
    check(lambda f, i: torch.log_softmax(f, -1).gather(0, i),
          "gather from the log_softmax row on a dim other than vocab", None,
          torch.zeros(1, W * VS, dtype=torch.int64))
    check(lambda f, i: torch.log_softmax(f, -1).gather(-1, i),
          "gather index leading dims differ from the logits' (beyond 2-D)",
          torch.randn(B, 3, VS), torch.zeros(B, 1, 2, dtype=torch.int64))

    g, gather = _trace(group, lambda f, i: torch.log_softmax(f, -1).gather(-1, i), None,
                       torch.zeros(B, 2, dtype=torch.int64))
    flat = g.placeholder("flat_index")
    flat.meta["val"] = placeholders(g)[1].meta["val"].flatten()
    node(g, aten.gather.default).update_arg(2, flat)
    assert_miss(match_row_reads(gather), "gather index of another rank")
