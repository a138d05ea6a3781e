"""commfold.shard.payload against a plain full-row torch reference, ranks simulated in
one process (harness.fake_comm): the first maximum over ranks is argmax's over the
row (ties to the lowest id, within and across ranks, rows all -inf, ranks holding
only padding), NaN anywhere gives None, the value bits travel exactly, and the words
of any dtypes come back bit for bit."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfold.shard import payload
from commfold.shard.layout import Layout
from harness.fake_comm import ranks


def _local_max(x: torch.Tensor, rank: int, shard: int):
    """One rank's (value, global id) of its first maximum over its real columns (-inf
    and its start where it holds none: a rank of padding only), NaN where it has one."""
    vocab = x.shape[1]
    start = rank * shard
    n = max(0, min(shard, vocab - start))
    if not n:
        return (x.new_full(x.shape[:1], float("-inf")),
                torch.full(x.shape[:1], start, dtype=torch.int64))
    value, index = x[:, start:start + n].max(dim=-1)  # torch: a NaN is the maximum
    return value, index + start


def _rows(seed: int, rows: int, vocab: int, dtype, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct values: ties within and across shards
        x = torch.randint(0, 3, (rows, vocab), generator=g).to(dtype)
    else:
        x = torch.randn(rows, vocab, generator=g, dtype=torch.float64).to(dtype)
    if kind == "neg_inf":  # rows of -inf, whole or in part
        x[0] = float("-inf")
        x[1:, : vocab // 2] = float("-inf")
    return x


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(2, 5), vocab=st.integers(1, 67),
       world=st.integers(1, 8), dtype=st.sampled_from([torch.float32, torch.float64]),
       kind=st.sampled_from(["ties", "randn", "neg_inf"]))
def test_first_max_over_ranks_is_argmax_over_the_row(seed, rows, vocab, world, dtype, kind):
    x = _rows(seed, rows, vocab, dtype, kind)
    shard = -(-vocab // world)  # the last ranks may hold padding only

    def rank(comm):
        value, index = _local_max(x, comm.rank(), shard)
        return payload.first_max(comm, value, index)

    got = ranks(world, rank)
    want = x.argmax(dim=-1)
    for r, firsts in enumerate(got):
        assert firsts is not None and firsts.edge is None
        assert torch.equal(firsts.tokens, want), (r, firsts.tokens, want)
    assert got.sent == [rows * 2 * 8] * world and got.calls == [1] * world


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 50), world=st.integers(1, 6),
       where=st.integers(0, 10**6))
def test_a_nan_anywhere_gives_none_on_every_rank(seed, vocab, world, where):
    x = _rows(seed, 3, vocab, torch.float32, "randn")
    x.view(-1)[where % x.numel()] = float("nan")
    shard = -(-vocab // world)
    got = ranks(world, lambda comm: payload.first_max(comm, *_local_max(x, comm.rank(),
                                                                        shard)))
    assert list(got) == [None] * world


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 40), world=st.integers(1, 5))
def test_rivals_not_below_the_maximum_mark_the_row(seed, vocab, world):
    """rival: a row's best value among tokens in doubt; edge where one reaches the row's
    maximum (and is a token at all: not -inf)."""
    x = _rows(seed, 4, vocab, torch.float32, "ties")
    g = torch.Generator().manual_seed(seed + 1)
    near = torch.where(torch.rand(x.shape, generator=g) < 0.3,
                       torch.randint(0, 4, x.shape, generator=g).float(), float("-inf"))
    shard = -(-vocab // world)

    def rank(comm):
        start = comm.rank() * shard
        n = max(0, min(shard, vocab - start))
        rival = near[:, start:start + n].amax(-1) if n else near.new_full((4,),
                                                                          float("-inf"))
        return payload.first_max(comm, *_local_max(x, comm.rank(), shard), rival)

    best = near.amax(-1)
    want = (best >= x.amax(-1)) & (best > float("-inf"))
    for firsts in ranks(world, rank):
        assert torch.equal(firsts.tokens, x.argmax(-1)) and torch.equal(firsts.edge, want)


SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.4e38, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_value_bits_travel_exactly(dtype):
    """Every bit pattern, NaN payloads and -0.0 too, comes back as it went."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31, (1000,), generator=g, dtype=torch.int64)
    if dtype == torch.float64:
        bits = bits * 2**32 + torch.randint(0, 2**32, (1000,), generator=g)
    raw = bits.to(payload.BITS[dtype]).view(dtype)
    values = torch.cat([raw, torch.tensor(SPECIAL, dtype=dtype)])
    back = payload.bits_value(payload.value_bits(values), dtype)
    assert torch.equal(back.view(payload.BITS[dtype]), values.view(payload.BITS[dtype]))
    assert payload.value_bits(values).dtype == torch.int64


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(0, 4), n=st.integers(0, 9),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32,
                              torch.float64, torch.int64, torch.int32, torch.uint8]))
def test_words_round_trip_any_dtype(seed, rows, n, dtype):
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    x = torch.randint(0, 256, (rows, n * size), generator=g, dtype=torch.uint8)
    x = x.view(dtype) if x.numel() else torch.empty(rows, n, dtype=dtype)
    w = payload.words(x)
    assert w.dtype == torch.int32 and w.shape == (rows, -(-n * size // 4))
    back = payload.unwords(w, dtype, n)
    assert back.shape == x.shape and back.dtype == dtype
    if x.numel():
        assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("world,vocab,dtype,fp64", [
    (2, 20011, torch.bfloat16, False), (4, 40000, torch.float16, True),
    (3, 24577, torch.float32, False), (1, 8192, torch.bfloat16, False)])
def test_a_draft_steps_parts_come_back_whole_and_cost_draft_bytes(world, vocab, dtype,
                                                                   fp64):
    """draft_parts through one exchange: every rank's parts, bit for bit, in rank order;
    the bytes each rank sends are draft_bytes'."""
    rows = 3
    shard = -(-vocab // world)
    lay = Layout(shard, vocab, world)
    g = torch.Generator().manual_seed(vocab)
    full = torch.randn(rows, world * shard, generator=g).to(dtype)
    vdtype = torch.float64 if fp64 else torch.float32

    def parts(rank):
        value = torch.randn(rows, generator=torch.Generator().manual_seed(rank),
                            dtype=torch.float64).to(vdtype)
        index = torch.arange(rows) + rank * shard
        shard_x = full[:, rank * shard:(rank + 1) * shard]
        return payload.draft_parts(value, index, shard_x[:, :1], lay, rank, shard_x)

    got = ranks(world, lambda comm: payload.exchange(comm, parts(comm.rank())))
    for mine in got:
        for q in range(world):
            for a, b in zip(mine, parts(q)):
                assert a[q].dtype == b.dtype and torch.equal(a[q].view(torch.uint8),
                                                              b.view(torch.uint8))
    assert got.sent == [payload.draft_bytes(rows, shard, vocab, world,
                                            full.element_size(), fp64)] * world


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 40), world=st.integers(1, 5))
def test_nan_as_neg_inf_on_shards_is_the_rows_greedy_argmax(seed, vocab, world):
    """Masked on each shard, the first maximum over ranks is vLLM 0.34's greedy_argmax
    of the gathered row (NaN as -inf; a row of NaN only: id 0)."""
    x = _rows(seed, 3, vocab, torch.float32, "ties")
    g = torch.Generator().manual_seed(seed)
    x[torch.rand(x.shape, generator=g) < 0.3] = float("nan")
    x[0] = float("nan")
    shard = -(-vocab // world)
    masked = payload.nan_as_neg_inf(x)
    want = torch.where(x.isnan(), float("-inf"), x).argmax(-1)
    got = ranks(world, lambda comm: payload.first_max(comm, *_local_max(masked, comm.rank(),
                                                                        shard)))
    for firsts in got:
        assert torch.equal(firsts.tokens, want)
