"""commfold.shard.accept against a plain per-request loop: V2's strict greedy rule
(accept drafts while each equals the target's argmax at the row before and is no
placeholder; the first rejected or the bonus position takes the target's token) and
the token scored at each logits row after."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfold.shard.accept import greedy, verified_tokens

np = pytest.importorskip("numpy", reason="V2's arrays are numpy; commfold needs none")


def _reference(draft, argmax, cu, steps):
    sampled, num = [], []
    for r in range(len(cu) - 1):
        lo, hi = cu[r], cu[r + 1]
        out = []
        for i in range(lo, hi):
            out.append(argmax[i])
            nxt = draft[i + 1] if i + 1 < hi else None
            if nxt is None or nxt < 0 or nxt != argmax[i]:
                break
        num.append(len(out))
        row = [int(a) for a in argmax[lo:hi]] + [0] * (steps + 1 - (hi - lo))
        row[:len(out)] = out
        sampled.append(row)
    return sampled, num


@settings(max_examples=80, deadline=None)
@given(steps=st.integers(1, 4), seed=st.integers(0, 2**16), reqs=st.integers(1, 5))
def test_greedy_accepts_as_a_plain_loop(steps, seed, reqs):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, steps + 2, reqs)  # a request's rows: its drafts + 1
    cu = np.concatenate([[0], np.cumsum(counts)])
    rows = int(cu[-1])
    argmax = torch.as_tensor(rng.integers(0, 3, rows), dtype=torch.int64)
    draft = torch.as_tensor(rng.integers(-1, 3, rows), dtype=torch.int64)
    sampled, num = greedy(draft, argmax, cu, reqs, steps)
    want, want_num = _reference(draft.tolist(), argmax.tolist(), cu.tolist(), steps)
    assert num.dtype == torch.int32 and num.tolist() == want_num
    for r in range(reqs):  # past num_sampled V2's output is not read
        assert sampled[r, :want_num[r]].tolist() == want[r][:want_num[r]]
    flat = verified_tokens(sampled, num, cu)
    for r in range(reqs):
        for i in range(int(counts[r])):
            expect = want[r][i] if i < want_num[r] else 0
            assert int(flat[cu[r] + i]) == expect, (r, i)
