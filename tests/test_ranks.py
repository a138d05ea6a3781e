"""The multi-rank harness: results in rank order, a failing rank's traceback in the
error, a hang turned into a timeout error instead of a stuck test."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from commfold.distributed.ranks import RankError, RankPool, run_on_ranks, start_forkserver

pytestmark = pytest.mark.ranks


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


def test_results_in_rank_order():  # (a pool's: test_dead_ranks_fail_the_call_in_seconds)
    assert run_on_ranks(rank_and_sum, 2) == [(0, 3.0), (1, 3.0)]


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


def die_on_ranks(hows: dict):
    """Each rank in `hows` says something on stderr and dies mid-call, the way named;
    the others wait for them in a collective that never completes."""
    import os
    import signal
    import sys

    how = hows.get(dist.get_rank())
    if how:
        print(f"rank {dist.get_rank()} about to die by {how} at {time.time():.3f}",
              file=sys.stderr, flush=True)
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(60)  # not reached
    dist.barrier()
    return "unreachable"


DEATHS = {"SIGILL": "died: SIGILL", "SIGKILL": "died: SIGKILL", "exit": "died: exit code 3"}


def seconds_since_death(msg: str, how: str, rank: int) -> float:
    """From the dying rank's last stderr line (in the error: the tail) to now."""
    died = re.search(rf"rank {rank} about to die by {how} at ([0-9.]+)", msg)
    assert died, f"the error lacks the tail of rank {rank}'s stderr:\n{msg}"
    return time.time() - float(died.group(1))


def test_dead_ranks_fail_the_call_in_seconds():
    """Three ranks of four die in one call, one each way (a signal the process cannot
    catch, one faulthandler reports, a plain exit): each is named with its cause."""
    pool = RankPool(4, timeout=300)
    assert pool.run(rank_and_sum) == [(r, 10.0) for r in range(4)]  # up, in rank order
    hows = dict(zip([1, 2, 3], DEATHS))
    with pytest.raises(RankError) as err:
        pool.run(die_on_ranks, hows)
    msg = str(err.value)
    for rank, how in hows.items():
        assert seconds_since_death(msg, how, rank) < 5, "a dead rank must not wait out the timeout"
        assert f"rank {rank} {DEATHS[how]}" in msg, msg
    # faulthandler's report of the fatal signal, with the stack
    assert "Fatal Python error" in msg and "die_on_ranks" in msg, msg
    assert not pool.alive


def test_dead_rank_fails_a_one_shot_run_in_seconds():
    """Rank 1 dies: the error leads with it, not with rank 0, which only lost its peer."""
    with pytest.raises(RankError, match="rank 1 died: SIGILL") as err:
        run_on_ranks(die_on_ranks, 2, {1: "SIGILL"}, timeout=300)
    msg = str(err.value)
    assert seconds_since_death(msg, "SIGILL", 1) < 5
    assert msg.split("--- rank ")[1].startswith("1 failed ---\nrank 1 died: SIGILL"), msg
    assert "--- rank 0 failed (a peer left its collective) ---" in msg, msg


START_METHODS = """
import json, os, sys
from commfold.distributed.ranks import RankPool, environment_kept

def seen(name):  # what a rank sees: the variable, and whether Inductor came preloaded
    preloaded = "torch._inductor.compile_fx" in sys.modules
    from commfold.distributed.compile_once import installed  # (imports Inductor)
    assert not installed()  # compile_once=False: Inductor left alone
    return os.environ.get(name), preloaded

if __name__ == "__main__":
    out = []
    for value in (None, None, "changed"):  # the environment changes before the third
        if value:
            os.environ["COMMFOLD_TEST_VARIABLE"] = value
        pool = RankPool(1 if value else 2, timeout=120, compile_once=False)  # (spawn: 1)
        out.append([pool.start_method, pool.spawn_reason,
                    pool.run(seen, "COMMFOLD_TEST_VARIABLE")])
        pool.close()
        with environment_kept():  # a passing change, taken back: the next pool forks
            os.environ["COMMFOLD_PASSING_VARIABLE"] = "1"
            os.environ.pop("HOME", None)
    print(json.dumps(out))
"""


def test_ranks_fork_from_a_preloaded_server_until_the_environment_changes(tmp_path):
    """In a fresh process: two pools forked from commfold's forkserver (Inductor already
    imported there; a change inside environment_kept() between them is taken back),
    then, after the environment changed for good, a spawned pool whose ranks see the
    change (a forked rank would carry the server's import-time settings), saying why.
    Their compile_once=False leaves Inductor unpatched."""
    script = tmp_path / "start_methods.py"
    script.write_text(START_METHODS)
    env = {k: v for k, v in os.environ.items() if k != "COMMFOLD_TEST_VARIABLE"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    why = ("the environment changed since commfold's forkserver started "
           "(COMMFOLD_TEST_VARIABLE set)")
    assert out == [["forkserver", None, [[None, True]] * 2],
                   ["forkserver", None, [[None, True]] * 2],
                   ["spawn", why, [["changed", False]]]], out


@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver start method: Linux here")
def test_pools_here_fork_from_the_preloaded_server():
    """conftest starts commfold's forkserver before the first test and every test
    leaves os.environ as it found it, so pools started here, after whatever this
    worker ran before, still fork: a leaked variable (vLLM sets some at import) made
    every later pool spawn its ranks."""
    assert start_forkserver() == "forkserver"
    pool = RankPool(1, timeout=60, compile_once=False)
    try:
        assert pool.start_method == "forkserver", pool.spawn_reason
    finally:
        pool.close()


def inductor_preloaded() -> bool:
    return "torch._inductor.compile_fx" in sys.modules


def test_spawn_starts_ranks_in_fresh_interpreters():
    """spawn=True (the GPU check's pools): no rank forked from the preloaded server,
    whatever the environment."""
    pool = RankPool(1, timeout=120, compile_once=False, spawn=True)
    try:
        assert (pool.start_method, pool.spawn_reason) == ("spawn", "spawn=True")
        assert pool.run(inductor_preloaded) == [False]
    finally:
        pool.close()
