"""Shared fixtures: rank pools of 2 and 4 gloo ranks, started once per session and
restarted after a failed call (a rank stuck in a collective is not reused)."""
import pytest

from commfold.ranks import RankPool


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
