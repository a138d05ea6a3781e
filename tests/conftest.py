"""Shared fixtures: rank pools of 2 and 4 gloo ranks, started once per session and
restarted after a failed call (a rank stuck in a collective is not reused)."""
import os

import pytest

from commfold.testing import RankPool

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")

_pools: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = RankPool(world_size, timeout=600)
    return pool


@pytest.fixture
def ranks2() -> RankPool:
    return _pool(2)


@pytest.fixture
def ranks4() -> RankPool:
    return _pool(4)


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def ranks(request) -> RankPool:
    return _pool(request.param)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
