"""patterns.vocab_parallel on post-grad graphs of a fake process group (no ranks,
milliseconds each): vocab-parallel embeddings (torch's and vLLM's id arithmetic) give
the served id ranges, LM heads their matmul, shard and valid vocab; every near-miss
its reason."""
from __future__ import annotations

import functools
import operator

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from harness.post_grad import assert_miss, fake_world, node, nodes, placeholders, post_grad
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import commfold
from commfold.patterns.common import aten, c10d
from commfold.patterns.gather import match_vocab_gather
from commfold.patterns.vocab_parallel import (IdRange, VocabParallelEmbedding,
                                              embedding_candidates, match_embedding,
                                              match_lm_head)

W, VS, H = 2, 8, 4
pytestmark = pytest.mark.filterwarnings("ignore:.*all_gather_tensor.*:FutureWarning")


@pytest.fixture(scope="module")
def group():
    with fake_world(W) as g:
        yield g


def _ids(n=6, dtype=torch.int64):
    return torch.arange(n, dtype=dtype)


def _embedding(graph):
    lookup, = embedding_candidates(graph)
    return match_embedding(lookup)


def torch_embedding(group, lo=VS, hi=2 * VS, op="sum"):
    """A vocab-parallel embedding as torch users write it (rank 1's bounds)."""
    def fn(ids, w):
        mask = (ids < lo) | (ids >= hi)
        e = F.embedding((ids - lo).masked_fill(mask, 0), w)
        return funcol.all_reduce(e.masked_fill(mask[..., None], 0.0), op, group)
    return fn


def test_torch_embedding(group):
    g = post_grad(torch_embedding(group), _ids(), torch.randn(VS, H))
    ids, w = placeholders(g)
    ar, wait = node(g, c10d.all_reduce.default), node(g, c10d.wait_tensor.default)
    assert _embedding(g) == VocabParallelEmbedding(
        ids, w, (IdRange(VS, 2 * VS, 0),), wait, f"c10d:{group.group_name}", (ar, wait),
        node(g, aten.embedding.default))


def test_vllm_embedding_with_added_vocab(group):
    """vLLM's arithmetic: the base vocab shard [8, 16) in rows 0..7, the added vocab
    [40, 44) in rows 10..13 (after 2 padding rows); masks multiplied by offsets."""
    org, added, pad = (8, 16), (40, 44), 2

    def fn(ids, w):
        org_mask = (ids >= org[0]) & (ids < org[1])
        added_mask = (ids >= added[0]) & (ids < added[1])
        added_offset = added[0] - (org[1] - org[0]) - pad
        offset = org[0] * org_mask + added_offset * added_mask
        mask = org_mask | added_mask
        e = F.embedding(mask * (ids - offset), w)
        return funcol.all_reduce(e.masked_fill((~mask).unsqueeze(-1), 0), "sum", group)

    m = _embedding(post_grad(fn, _ids(), torch.randn(14, H)))
    assert m.ranges == (IdRange(8, 16, 0), IdRange(40, 44, 10))


def test_plain_embedding_is_not_this_pattern(group):
    assert _embedding(post_grad(lambda ids, w: F.embedding(ids, w), _ids(),
                                torch.randn(VS, H))) is None


def test_embedding_misses(group):
    def check(fn, reason, ids=None, w=None):
        g = post_grad(fn, _ids() if ids is None else ids, torch.randn(VS, H) if w is None else w)
        assert_miss(_embedding(g), reason)
        return g

    def emb(mask, idx, w):
        e = F.embedding(idx, w)
        zeroed = e.masked_fill(mask[..., None], 0.0) if mask is not None else \
            torch.where(idx[:, None] > 3, 0.0, e)  # a per-id test, but not a mask
        return funcol.all_reduce(zeroed, "sum", group)

    check(torch_embedding(group, op="avg"), "all-reduce with op 'avg', not a sum")
    check(lambda ids, w: emb(None, ids.clamp(0, VS - 1), w),
          "rows are zeroed by something other than a per-id mask")

    def two_inputs(ids, w, ids2):
        return emb(ids >= VS, ids2 - VS, w)

    g = post_grad(two_inputs, _ids(), torch.randn(VS, H), _ids() + VS)
    assert_miss(_embedding(g), "index and mask are not computed from the same ids")
    g = post_grad(lambda ids, w, ids2: emb(ids >= VS, ids - VS + ids2, w), _ids(),
                  torch.randn(VS, H), _ids())
    assert_miss(_embedding(g), "index arithmetic reads more than the ids (not a range mask)")
    check(lambda ids, w: emb(ids >= VS, (ids.float() - VS).long(), w),
          "ids arithmetic leaves integer/bool tensors")
    check(lambda ids, w: emb(ids >= VS, (ids - VS).long(), w), "ids are not int32/int64",
          _ids(dtype=torch.int16))
    check(torch_embedding(group, lo=1 << 23, hi=(1 << 23) + VS),
          "id arithmetic constants too large to analyse")
    check(torch_embedding(group, lo=VS, hi=20), "some ids index rows outside the shard")
    check(lambda ids, w: emb(ids < VS, torch.where(ids < 2 * VS, ids - VS, 0).masked_fill(
        ids < VS, 0), w), "ids far outside the vocabulary are looked up (no range mask)")

    def every_other_id(ids, w):  # 9 served ids, none next to another: 9 ranges
        served = functools.reduce(operator.or_, [ids == v for v in range(VS, VS + 18, 2)])
        return emb(~served, torch.where(served, ids - VS, 0), w)

    check(every_other_id, "served ids form too many ranges", None, torch.randn(20, H))
    check(torch_embedding(group, lo=-4, hi=4), "negative ids are served")

    g = post_grad(torch_embedding(group), _ids(), torch.randn(VS, H))
    shard = placeholders(g)[1]
    shard.meta["val"] = shard.meta["val"].unsqueeze(0)  # no lookup reads such a weight
    assert_miss(_embedding(g), "embedding weight is not a 2-D tensor")

    g = post_grad(torch_embedding(group), _ids(), torch.randn(VS, H))
    bound = g.placeholder("lo")
    bound.meta["val"] = ShapeEnv().create_unbacked_symint()
    node(g, aten.sub.Tensor).update_arg(1, bound)
    assert_miss(_embedding(g), "shard bounds are run-time symbols (ints made dynamic), not "
                "constants")

    g = post_grad(lambda ids, w: emb(ids >= VS, (ids - VS).to(torch.int32), w), _ids(),
                  torch.randn(VS, H))
    node(g, torch.ops.prims.convert_element_type.default).update_arg(1, torch.float32)
    assert_miss(_embedding(g), "ids are cast to a non-integer type")

    g = post_grad(torch_embedding(group), _ids(), torch.randn(VS, H))
    node(g, aten.sub.Tensor).update_arg(1, "eight")  # no op takes it
    assert_miss(_embedding(g), "id arithmetic could not be evaluated (RuntimeError)")

    g = post_grad(torch_embedding(group), _ids(), torch.randn(VS, H))
    zero = next(n for n in g.nodes if n.target is aten.full.default and n.args[1] == 0
                and n.kwargs["dtype"] == torch.int64)
    zero.update_arg(0, [3, 1])  # broadcasts the index to [3, ids]
    assert_miss(_embedding(g), "id arithmetic is not elementwise")


# ------------------------------------------------------------------ LM heads

def _head(group, logits, *inputs, cut=13):
    def fn(*args):
        full = funcol.all_gather_tensor(logits(*args), -1, group)
        return full[..., :cut] if cut else full
    g = post_grad(fn, *inputs)
    gather = match_vocab_gather(node(g, c10d.all_gather_into_tensor.default))
    return g, match_lm_head(gather), gather


def test_lm_head(group):
    g, m, gather = _head(group, lambda h, w: h @ w.t(), torch.randn(3, H), torch.randn(VS, H))
    h, w = placeholders(g)
    assert (m.hidden, m.shard, m.gather, m.reshape) == (h, w, gather, None)
    assert (m.valid_vocab, m.output) == (13, node(g, aten.slice.Tensor))


def test_lm_head_3d_hidden_unpadded(group):
    g, m, _ = _head(group, lambda h, w: F.linear(h, w), torch.randn(2, 3, H),
                    torch.randn(VS, H), cut=None)
    assert m.reshape is node(g, aten.mm.default).next and m.reshape.target is \
        aten.reshape.default
    assert (m.valid_vocab, m.output) == (0, node(g, aten.cat.default))


def test_lm_head_through_inductor_pad_mm(group):
    """The padded matmul Inductor's pad_mm makes on GPUs when its timed benchmark
    favours it (mm of zero-padded operands, sliced back), written out here: the same
    head, so ranks whose benchmarks chose differently decide the same."""
    def padded(h, w):
        return torch.mm(F.pad(h, (0, 0, 0, 5)), F.pad(w.t(), (0, 3)))[:-5, :-3]

    g, m, gather = _head(group, padded, torch.randn(3, H), torch.randn(VS, H))
    assert len(nodes(g, aten.constant_pad_nd.default)) == 2  # the form under test
    h, w = placeholders(g)
    assert (m.hidden, m.shard, m.gather) == (h, w, gather)
    # padded on the left (not pad_mm's form): the kept part is not the product
    _, m, _ = _head(group, lambda h, w: torch.mm(h, F.pad(w.t(), (3, 0)))[:, :-3],
                    torch.randn(3, H), torch.randn(VS, H))
    assert m is None
    commfold.CommfoldPass(commfold.Config(passes=("replicate_vocab_parallel",),
                                          strict=True))(g)
    assert commfold.last_report().count("replicate_vocab_parallel") == 1


def test_logits_not_from_a_matmul(group):
    _, m, _ = _head(group, lambda x: x * 2, torch.randn(3, VS))
    assert m is None


def test_lm_head_misses(group):
    _, m, _ = _head(group, lambda h, w, b: F.linear(h, w, b), torch.randn(3, H),
                    torch.randn(VS, H), torch.randn(VS))
    assert_miss(m, "vocab-parallel LM head with a bias")
    _, m, _ = _head(group, lambda h, w: h @ w, torch.randn(3, H), torch.randn(H, VS))
    assert_miss(m, "LM head weight is not used transposed ([vocab, hidden] layout)")
    _, m, _ = _head(group, lambda h, w: (h @ w.t()).reshape(6, VS // 2), torch.randn(3, H),
                    torch.randn(VS, H))
    assert_miss(m, "logits reshaped other than by their leading dims")
    g, _, gather = _head(group, lambda h, w: h @ w.t(), torch.randn(3, H), torch.randn(VS, H))
    w = placeholders(g)[1]
    w.meta["val"] = w.meta["val"].to(torch.float64)
    assert_miss(match_lm_head(gather), "LM head weight is not a 2-D tensor of the hidden dtype")


@pytest.mark.vllm(group="module")  # imports vLLM in this process
def test_lm_head_on_a_packed_weight(group):
    """vLLM CPU's LM head multiplies by a weight it packed for oneDNN at load
    (``_C.onednn_mm`` with a handle): no weight in the graph, so no replication - and
    the near-miss says why (vLLM's own kernels, loaded the way vLLM loads them)."""
    from harness.post_grad import require_vllm_kernels

    require_vllm_kernels()

    def logits(h, handle):
        out = torch.empty(h.shape[0], VS)
        torch.ops._C.onednn_mm(out, h, None, handle)
        return out

    _, m, _ = _head(group, logits, torch.randn(3, H), torch.zeros(1, dtype=torch.int64))
    assert_miss(m, "LM head matmul on a packed weight (vLLM CPU's _C.onednn_mm): the weight "
                   "is not in the graph to replicate")
