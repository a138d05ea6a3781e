"""commfold.shard.columns: a request's per-vocab state re-expressed in a shard's
columns - packed bit masks shifted across 32-token words, token id lists cut to the
shard - checked bit by bit against the full vocab's."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfold.shard.columns import shard_bits, shard_ids, shard_mask

np = pytest.importorskip("numpy", reason="V2's arrays are numpy; commfold needs none")


@settings(max_examples=60, deadline=None)
@given(words=st.integers(1, 9), start=st.integers(0, 250), n=st.integers(0, 60),
       seed=st.integers(0, 2**16))
def test_shard_bits_repacks_v2s_prompt_mask(words, start, n, seed):
    """The bits V2's penalties kernel reads for shard column j (word j // 32, bit
    j % 32 of the shard's mask) are the full mask's bits for token start + j, for
    the step's requests, at any start (aligned: a view)."""
    vocab = 32 * words
    start, n = min(start, vocab), min(n, vocab - min(start, vocab))
    g = torch.Generator().manual_seed(seed)
    mask = torch.randint(-2**31, 2**31, (5, words), generator=g, dtype=torch.int64).int()
    idx = [3, 0, 4]
    got = shard_bits(mask, start, n, idx)

    def bit(m, row, t):
        return (int(m[row, t // 32]) >> (t % 32)) & 1

    for row in idx:
        assert [bit(got, row, j) for j in range(n)] == \
            [bit(mask, row, start + j) for j in range(n)], (row, start, n)
    if start % 32 == 0:
        assert got.data_ptr() == mask[:, start // 32:].data_ptr()


@settings(max_examples=60, deadline=None)
@given(words=st.integers(1, 9), start=st.integers(0, 250), n=st.integers(1, 60),
       rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_shard_mask_repacks_v2s_grammar_bitmask(words, start, n, rows, seed):
    """Shard column j of the re-packed bitmask (word j // 32, bit j % 32) is the
    scheduler's bit for token start + j, every row, any start; same shape, words
    past the shard zero."""
    vocab = 32 * words
    start = min(start, vocab - 1)
    n = min(n, vocab - start)
    mask = np.random.default_rng(seed).integers(-2**31, 2**31, (rows, words),
                                                 dtype=np.int64).astype(np.int32)
    got = shard_mask(mask, start, n)

    def bit(m, row, t):
        return (int(m[row, t // 32]) >> (t % 32)) & 1

    assert got.shape == mask.shape and got.dtype == np.int32
    for row in range(rows):
        assert [bit(got, row, j) for j in range(n)] == \
            [bit(mask, row, start + j) for j in range(n)], (row, start, n)
    assert not got[:, -(-n // 32):].any()


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 200), start=st.integers(0, 200), n=st.integers(0, 80),
       spare=st.booleans(), seed=st.integers(0, 2**16))
def test_shard_ids_keep_the_shards_ids_as_columns(vocab, start, n, spare, seed):
    """Each slot's ids in [start, start + n), in their order, as shard columns, their
    values beside them; spare (the allowed ids': no values): a slot with ids but none
    here gets column n."""
    rng = np.random.default_rng(seed)
    slots, most = 4, 6
    counts = rng.integers(0, most + 1, slots)
    ids = torch.as_tensor(rng.integers(0, vocab, (slots, most)), dtype=torch.int32)
    values = torch.as_tensor(rng.standard_normal((slots, most)), dtype=torch.float32)
    asked = [2, 0, 3]
    got_n, got, got_values = shard_ids(counts, ids, asked, start, n, spare,
                                       None if spare else values)
    assert (got_values is None) == spare
    for slot in range(slots):
        if slot not in asked:
            assert int(got_n[slot]) == 0
            continue
        row = ids[slot, :counts[slot]].tolist()
        here = [(t - start, float(values[slot, i])) for i, t in enumerate(row)
                if start <= t < start + n]
        if spare and row and not here:
            assert int(got_n[slot]) == 1 and int(got[slot, 0]) == n
            continue
        k = int(got_n[slot])
        assert got[slot, :k].tolist() == [c for c, _ in here]
        if got_values is not None:
            assert got_values[slot, :k].tolist() == [v for _, v in here]
