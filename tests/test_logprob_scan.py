"""torch.topk's exact result (its CPU heap order among ties included) from each shard's
heap candidates (commfold.ops.logprob_scan), the C++ scan and the torch-ops
fallback alike; the C++ scan finds exactly the entries a running top-k takes in."""
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
