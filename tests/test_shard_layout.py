"""commfold.shard.layout: which 8192-column blocks each rank verifies and the columns
its neighbours lend, checked on ranks simulated in one process (harness.fake_comm)
against the full row: every block is assembled whole once, by the rank holding most
of it, at any vocab (odd ones, fewer blocks than ranks) and world size."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfold.shard.layout import BLOCK, Layout, exchanged_bytes, no_saving, sent, whole_blocks
from harness.fake_comm import ranks


def _check_whole_blocks(shard: int, vocab: int, world: int) -> None:
    lay = Layout(shard, vocab, world)
    owned = [b for q in range(world) for b in range(lay.first[q], lay.first[q + 1])]
    assert owned == list(range(-(-vocab // BLOCK)))
    for b in range(lay.blocks):  # the owner holds most of the block, the first on a tie
        lo, hi = b * BLOCK, min((b + 1) * BLOCK, vocab)
        held = [max(0, min(hi, lay.columns(q)[1]) - max(lo, lay.columns(q)[0]))
                for q in range(world)]
        owner = next(q for q in range(world) if lay.first[q] <= b < lay.first[q + 1])
        assert owner == held.index(max(held)), (b, held)
    row = torch.arange(world * shard, dtype=torch.float64)[None]
    row[:, vocab:] = -1.0  # padding: never part of a block

    def rank(comm):
        q = comm.rank()
        mine = row[:, q * shard:(q + 1) * shard]
        return whole_blocks(comm, lay, mine), sent(lay, q, mine)

    got = ranks(world, rank)
    for q, (blocks, what) in enumerate(got):
        lo, hi = lay.span(q)
        assert blocks[0].tolist() == [float(c) for c in range(lo, hi)], q
        assert what.shape == (1, lay.width())
    assert got.calls == [1 if lay.width() else 0] * world
    if shard >= BLOCK:
        assert lay.width() <= BLOCK // 2 * (2 if world > 2 else 1), lay.width()


@pytest.mark.parametrize("shard,vocab,world", [
    (16384, 32768, 2), (10016, 20011, 2), (3000, 11000, 4), (8192, 8192, 1),
    (64128, 128256, 2), (75968, 151936, 2), (2000, 7999, 4), (5000, 40000, 8),
    (9000, 70000, 8), (70000, 139999, 2)])
def test_each_block_is_assembled_whole_once(shard, vocab, world):
    """Each 8192-column block is computed by one rank, from its own columns and the
    heads / tails its neighbours send; a split block costs its smaller part."""
    _check_whole_blocks(shard, vocab, world)


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 5 * BLOCK), world=st.integers(1, 8), pad=st.integers(0, 63))
def test_blocks_are_whole_at_any_vocab(vocab, world, pad):
    """Odd vocabularies, shards padded past the vocab (the last ranks' padding only)."""
    shard = -(-(vocab + pad) // world)
    _check_whole_blocks(shard, vocab, world)


def test_no_saving_is_the_byte_rule():
    """A layout whose verification sends, at its most, a shard's worth or more is
    refused; real vocabularies are not."""
    for shard, vocab, world in ((64128, 128256, 2), (18992, 151936, 8)):
        assert no_saving(shard, vocab, world, 2) is None
        assert exchanged_bytes(1, 0, shard, vocab, world, 2, True, True, True) < shard * 2
    for shard, vocab, world in ((1504, 3000, 2), (5008, 20011, 4)):
        assert no_saving(shard, vocab, world, 2) is not None
