"""torch.topk's exact result (its CPU heap order among ties included) from each shard's
heap candidates (commfold.ops.logprob_scan), the C++ scan and the torch-ops
fallback alike; the C++ scan (commfold's top-k scan) finds exactly the entries a
running top-k takes in, and a superset when a long row is split across threads; the
row statistics (max, log-sum-exp, first argmax) and the rank count match torch."""
from __future__ import annotations

import heapq
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfold.ops import logprob_scan as tc


def _running(row: list[float], k: int) -> list[int]:
    """The entries a heap of the k largest takes in, scanning left to right."""
    heap, taken = [], []
    for j, v in enumerate(row):
        if len(heap) < k:
            heapq.heappush(heap, v)
            taken.append(j)
        elif v > heap[0]:
            heapq.heapreplace(heap, v)
            taken.append(j)
    return taken


def _sharded_topk(x, k, world, find):
    vs = math.ceil(x.shape[1] / world)
    values, ids = [], []
    for r in range(world):
        shard = x[:, r * vs:(r + 1) * vs]
        idx, _ = find(shard, shard.shape[1], k)
        v = shard.float().gather(1, idx.clamp(min=0))
        values.append(torch.where(idx >= 0, v, -math.inf))
        ids.append(idx + r * vs)
    top, where = tc.heap_topk(torch.cat(values, 1), k)
    return top, torch.cat(ids, 1).gather(1, where)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(64, 3000), k=st.sampled_from([1, 2, 5, 20]), world=st.sampled_from([2, 4]),
       levels=st.sampled_from([3, 40, 0]), dtype=st.sampled_from(["float32", "bfloat16"]),
       seed=st.integers(0, 2**16), torch_ops=st.booleans())
def test_sharded_candidates_reproduce_torch_topk(n, k, world, levels, dtype, seed, torch_ops):
    """levels: values drawn from that many integers (ties everywhere), 0: continuous."""
    n = max(n, 64 * k)  # torch.topk's partial_sort path (vLLM's rows: k * 64 <= vocab)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (3, n), generator=g).float() if levels else \
        torch.randn(3, n, generator=g)
    x = x.to(getattr(torch, dtype))
    x[1, ::7] = -math.inf
    find = (lambda s, m, kk: tc._candidates_torch(s[:, :m], kk)) if torch_ops else tc.candidates
    top, ids = _sharded_topk(x, k, world, find)
    want_v, want_i = torch.topk(x.float(), k)
    assert torch.equal(top, want_v) and torch.equal(ids, want_i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_scan_is_exactly_the_running_top_k(dtype):
    if tc.module() is None:
        pytest.skip("no C++ toolchain here: the torch-ops superset is used")
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 30, (4, 700), generator=g).to(dtype)
    idx, counts = tc.candidates(x, 650, 5)  # only the first 650 columns count
    for row in range(4):
        want = _running(x[row, :650].float().tolist(), 5)
        assert counts[row] == len(want)
        assert idx[row, :len(want)].tolist() == want
        assert (idx[row, len(want):] == -1).all()


@pytest.fixture
def split_runs():
    """3 threads, rows split into column runs of >= 100 columns."""
    if tc.module() is None:
        pytest.skip("no C++ toolchain here: the torch-ops superset is used")
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    tc.module().set_min_run(100)
    yield
    torch.set_num_threads(old)
    tc.module().set_min_run(1 << 15)


def test_split_rows_give_a_superset_that_still_reproduces_torch_topk(split_runs):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 6, (2, 2000), generator=g).float()
    idx, counts = tc.candidates(x, 2000, 4)
    for row in range(2):
        got = idx[row, :counts[row]].tolist()
        assert got == sorted(got) and set(_running(x[row].tolist(), 4)) <= set(got)
    top, ids = _sharded_topk(x, 4, 2, tc.candidates)
    want_v, want_i = torch.topk(x, 4)
    assert torch.equal(top, want_v) and torch.equal(ids, want_i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_stats_and_rank_count_match_torch(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(4, 999, generator=g) * 5).to(dtype)
    x[1] = -math.inf  # a row of nothing but -inf: log-sum-exp -inf
    x[2, 500] = math.nan
    x[3, [3, 700]] = 40.0  # tied maxima: the first wins
    m, lse, first = tc.row_stats(x)
    want_m, want_first = x.float().max(-1)
    assert torch.equal(m[[0, 1, 3]], want_m[[0, 1, 3]]) and m[2].isnan()
    assert first.tolist() == [want_first[0].item(), want_first[1].item(), 500, 3]
    want_lse = torch.logsumexp(x.double(), -1)
    assert torch.allclose(lse[[0, 3]], want_lse[[0, 3]], rtol=1e-6) and lse[1] == -math.inf
    big_m, log_s = m.nan_to_num(0.0), lse.float().nan_to_num(0.0)
    t = x[:, 10].float() - big_m - log_s
    want = (((x.float() - big_m[:, None]) - log_s[:, None]) >= t[:, None]).sum(-1)
    assert torch.equal(tc.count_logprob_ge(x, 999, big_m, log_s, t), want)
