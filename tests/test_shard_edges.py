"""commfold.shard.edges: rows made whole from every rank's columns (ranks simulated in
one process, harness.fake_comm) are the full rows, padding cut, and cost what
gathered_bytes says; the byte rule lets at most half of vLLM's gather through."""
from __future__ import annotations

import pytest
import torch

from commfold.shard.edges import gathered_bytes, over_budget, whole
from harness.fake_comm import ranks


@pytest.mark.parametrize("vocab,world", [(10, 3), (7, 4), (32, 2), (5, 8), (1, 1)])
def test_rows_made_whole_are_each_ranks_columns_in_order(vocab, world):
    """whole(): the rows asked for, every rank's real columns side by side, the padding
    past the vocab cut (as V2's logits), contiguous; one gather of [d, shard] float32."""
    shard = -(-vocab // world)
    row = torch.arange(3 * vocab, dtype=torch.float32).view(3, vocab)
    which = torch.tensor([2, 0])

    def rank(comm):
        start = comm.rank() * shard
        return whole(comm, row[:, start:start + shard], which, shard, vocab)

    got = ranks(world, rank)
    for mine in got:
        assert torch.equal(mine, row[[2, 0]]) and mine.is_contiguous()
    assert got.sent == [gathered_bytes(2, shard)] * world


def test_rows_made_whole_cost_at_most_half_of_vllms_gather():
    """The rows' float32 columns at most half the bytes of vLLM's gather of the step's
    raw logits: a quarter of a bf16 step's rows, half a float32's."""
    assert over_budget(4, 16, 2) is None and "5 of 16 rows" in over_budget(5, 16, 2)
    assert over_budget(8, 16, 4) is None and over_budget(9, 16, 4) is not None
    assert over_budget(1, 3, 2) is not None and over_budget(1, 3, 4) is None
    for d, rows, item in ((4, 16, 2), (8, 16, 4), (64, 256, 2)):
        assert over_budget(d, rows, item) is None
        assert 2 * gathered_bytes(d, 75968) <= rows * 75968 * item
