"""The multi-rank harness: results in rank order, a failing rank's traceback in the
error, a hang turned into a timeout error instead of a stuck test."""
from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from commfold.ranks import RankError, RankPool, run_on_ranks


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


def die_on_rank_0(how, dying=0):
    """Rank `dying` says something on stderr and dies mid-call; the others wait for it
    in a collective that never completes."""
    import os
    import signal
    import sys

    if dist.get_rank() == dying:
        print(f"rank {dying} about to die by {how} at {time.time():.3f}", file=sys.stderr,
              flush=True)
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(60)  # not reached
    dist.barrier()
    return "unreachable"


DEATHS = {"SIGILL": "rank 0 died: SIGILL", "SIGKILL": "rank 0 died: SIGKILL",
          "exit": "rank 0 died: exit code 3"}


def seconds_since_death(msg: str, how: str) -> float:
    """From the dying rank's last stderr line (in the error: the tail) to now."""
    died = re.search(rf"rank 0 about to die by {how} at ([0-9.]+)", msg)
    assert died, f"the error lacks the tail of rank 0's stderr:\n{msg}"
    return time.time() - float(died.group(1))


@pytest.mark.parametrize("how", list(DEATHS))
def test_dead_rank_fails_the_call_in_seconds(how):
    pool = RankPool(2, timeout=300)
    assert pool.run(rank_and_sum)[0][0] == 0  # the pool is up
    with pytest.raises(RankError) as err:
        pool.run(die_on_rank_0, how)
    msg = str(err.value)
    assert seconds_since_death(msg, how) < 5, "a dead rank must not wait out the timeout"
    assert DEATHS[how] in msg, msg
    if how == "SIGILL":  # faulthandler's report of the fatal signal, with the stack
        assert "Fatal Python error" in msg and "die_on_rank_0" in msg, msg
    assert not pool.alive


def test_the_dead_rank_comes_before_the_ranks_that_lost_it():
    with pytest.raises(RankError) as err:
        run_on_ranks(die_on_rank_0, 2, "exit", 1, timeout=300)
    msg = str(err.value)
    first = msg.split("--- rank ")[1]
    assert first.startswith("1 failed ---\nrank 1 died: exit code 3"), msg
    assert "--- rank 0 failed (a peer left its collective) ---" in msg, msg


def test_dead_rank_fails_a_one_shot_run_in_seconds():
    with pytest.raises(RankError, match="rank 0 died: SIGILL") as err:
        run_on_ranks(die_on_rank_0, 2, "SIGILL", timeout=300)
    assert seconds_since_death(str(err.value), "SIGILL") < 5
