"""The multi-rank harness: results in rank order, a failing rank's traceback in the
error, a hang turned into a timeout error instead of a stuck test."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from commfold.testing import RankError, RankPool, run_on_ranks


def rank_and_sum():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits for a partner that never comes
    return "unreachable"


def sleep_forever():
    time.sleep(3600)


@pytest.mark.parametrize("world", [2, 4])
def test_results_in_rank_order(world):
    assert run_on_ranks(rank_and_sum, world) == [(r, world * (world + 1) / 2) for r in range(world)]


def test_failing_rank_traceback_is_reported():
    with pytest.raises(RankError) as err:
        run_on_ranks(fail_on_rank_1, 2, timeout=120)
    msg = str(err.value)
    assert "rank 1 failed" in msg and "ValueError: boom on rank one" in msg
    assert "fail_on_rank_1" in msg  # the traceback names the failing function


def test_hang_becomes_a_timeout_error():
    pool = RankPool(2, timeout=60)
    assert pool.run(rank_and_sum)[0][0] == 0  # the pool is up
    t0 = time.monotonic()
    with pytest.raises(RankError, match="did not finish within 3s"):
        pool.run(sleep_forever, timeout=3)
    assert time.monotonic() - t0 < 30
    assert not pool.alive  # a hung pool is not reused
