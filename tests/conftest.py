"""Shared fixtures: rank pools of 2 and 4 gloo ranks, started once per session and
restarted after a failed call (a rank stuck in a collective is not reused); and the
hypothesis profile: derandomized, so every run draws the same examples in the same
time (COMMFOLD_HYPOTHESIS=random draws fresh ones)."""
import os

import pytest
from hypothesis import settings

from commfold.ranks import RankPool

settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("random")
settings.load_profile("random" if os.environ.get("COMMFOLD_HYPOTHESIS") == "random"
                      else "fixed")

_pools: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = RankPool(world_size, timeout=600)
    return pool


class Ranks:
    """Handle to the session pool of `world_size` ranks; each run() uses a live pool
    (a new one after a failure), so hypothesis examples after a failing one still run."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def run(self, fn, *args, **kwargs) -> list:
        return _pool(self.world_size).run(fn, *args, **kwargs)


@pytest.fixture
def ranks2() -> Ranks:
    return Ranks(2)


@pytest.fixture
def ranks4() -> Ranks:
    return Ranks(4)


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def ranks(request) -> Ranks:
    return Ranks(request.param)


@pytest.fixture(scope="module")
def vllm_ranks():
    """2 ranks of a module's own for vLLM's groups (vLLM's state stays in them)."""
    pool = RankPool(2, timeout=300, threads=1)
    yield pool
    pool.close()


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
