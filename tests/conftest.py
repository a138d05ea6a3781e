"""Shared fixtures: rank pools (2 and 4 gloo ranks; 2 for vLLM), started once per session and
restarted after a failed call (a rank stuck in a collective is not reused); and the
hypothesis profile: derandomized, so every run draws the same examples in the same
time (COMMFOLD_HYPOTHESIS=random draws fresh ones); and which pytest-xdist worker runs
what (pyproject's addopts run every `pytest` on two workers; `-n 0` runs one process)."""
import collections
import os
import re

import pytest
from hypothesis import settings

from commfold.distributed.ranks import RankPool, environment_kept, start_forkserver

settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("random")
settings.load_profile("random" if os.environ.get("COMMFOLD_HYPOTHESIS") == "random"
                      else "fixed")

_pools: dict[str, RankPool] = {}
# name: (world size, RankPool keyword arguments)
_KINDS = {"2": (2, {"timeout": 600}), "4": (4, {"timeout": 600}),
          "vllm": (2, {"timeout": 300, "threads": 1}),
          # Model Runner V2: spawned, so harness.triton_cpu registers before vLLM imports
          # and Triton reads TRITON_INTERPRET at its own import
          # the pick's cost rule off: these test V2's picks on tiny vocabularies, where
          # the rule would leave logprobs steps to vLLM (commfold.vllm.target.pick_cost)
          # (10 minutes: a case list runs interpreted kernels, slow on a loaded machine)
          "vllm_v2": (2, {"timeout": 600, "threads": 1, "spawn": True,
                          "env": {"TRITON_INTERPRET": "1",
                                  "COMMFOLD_PICK_COST_RULE": "0"}})}
_KINDS["vllm_v2_4"] = (4, _KINDS["vllm_v2"][1])  # the same, 4 ranks


def _pool(kind: str) -> RankPool:
    pool = _pools.get(kind)
    if pool is None or not pool.alive:
        world_size, kwargs = _KINDS[kind]
        pool = _pools[kind] = RankPool(world_size, **kwargs)
    return pool


class Ranks:
    """Handle to a session pool (`kind`: "2", "4" or "vllm"); each run() uses a live
    pool (a new one after a failure), so hypothesis examples and test modules after a
    failing call still run."""

    def __init__(self, kind):
        self.kind = str(kind)
        self.world_size = _KINDS[self.kind][0]

    def run(self, fn, *args, **kwargs) -> list:
        return _pool(self.kind).run(fn, *args, **kwargs)


@pytest.fixture
def ranks2() -> Ranks:
    return Ranks(2)


@pytest.fixture
def ranks4() -> Ranks:
    return Ranks(4)


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def ranks(request) -> Ranks:
    return Ranks(request.param)


@pytest.fixture
def vllm_ranks() -> Ranks:
    """2 ranks for vLLM's groups, one thread each, shared by the vLLM test modules
    (each rank imports vLLM once, ~10 s a pool): every rank function sets up vLLM's
    groups itself (harness.vllm_tp.init_vllm_tp re-initializes them)."""
    return Ranks("vllm")


@pytest.fixture
def vllm_v2_ranks() -> Ranks:
    """2 spawned ranks where vLLM sees Triton (harness.triton_cpu): Model Runner V2's
    samplers run their Triton kernels in Triton's interpreter."""
    return Ranks("vllm_v2")


@pytest.fixture
def vllm_v2_ranks4() -> Ranks:
    """vllm_v2_ranks with 4 ranks (vocab shards that start inside a 32-token word)."""
    return Ranks("vllm_v2_4")


# Rank pools fork their ranks from commfold's preloaded server only while this
# process's environment is the one that server started with (commfold.distributed.ranks); a
# changed one spawns every later pool's ranks (~10 CPU-s of imports a rank). vLLM
# sets variables in the importing process (TORCHINDUCTOR_COMPILE_THREADS, ...; a
# VllmConfig adds VLLM_WORKER_MULTIPROC_METHOD, ...): kept, they made test_ranks cost
# 163 CPU-s instead of 32 on the worker that ran the vLLM modules first.


@pytest.fixture(scope="session", autouse=True)
def _rank_server_started_first(request):
    """commfold's forkserver starts before the first test, in the session's own
    environment, which every test then leaves as it found it; not in a run that
    selected no `ranks` test (the server preloads torch's compiler: CPU-seconds)."""
    if any(item.get_closest_marker("ranks") for item in request.session.items):
        start_forkserver()


@pytest.fixture(autouse=True)
def _no_environment_leaks():
    """Each test leaves os.environ as it found it (commfold.distributed.ranks.environment_kept)."""
    with environment_kept():
        yield


@pytest.fixture(scope="session")
def vllm_imported():
    """vLLM imported (or the test skipped / failed in CI, with the install hint): the
    vLLM test modules' mark (vllm_models.require_vllm_installed). The variables its
    import sets in this process are taken back: they were read as it set them."""
    from harness.vllm_models import require_vllm

    with environment_kept():
        return require_vllm()


@pytest.fixture(scope="session")
def spec_decode_run(request, tmp_path_factory):
    """The spec-decoding example's run (vllm_models.SpecDecodeRun), started by the
    vLLM group's first test and read by test_vllm_spec_decode.py; killed if still
    running at the end. Its methods: those of the selected tests (eagle3's are `slow`)."""
    from harness.vllm_models import SPEC_METHODS, SpecDecodeRun

    picked = {item.callspec.params.get("method") for item in request.session.items
              if item.path.name == "test_vllm_spec_decode.py" and hasattr(item, "callspec")}
    methods = tuple(m for m in SPEC_METHODS if m in picked) or SPEC_METHODS[:1]
    run = SpecDecodeRun(tmp_path_factory.mktemp("spec"), methods)
    yield run
    run.stop()


@pytest.fixture(autouse=True)
def _spec_decode_started_early(request):
    """The spec-decoding run's engines, the suite's dearest minutes, start in the
    background with the vLLM group's first test, so they overlap the rest of it."""
    if _group(request.node) == "vllm" and any(
            item.path.name == "test_vllm_spec_decode.py" for item in request.session.items):
        request.getfixturevalue("spec_decode_run").start()


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()


# --- tiers: pytest markers (registered in pyproject.toml) ---------------------------
# ranks: starts rank processes (any test that takes a rank-pool fixture is marked here);
# vllm: imports vLLM (harness.vllm_models.require_vllm_installed); engine: starts vLLM
# engines; gpu: needs a CUDA GPU; slow: opt-in, minutes each: deselected unless `-m`
# names it (`-m slow`, `-m "slow and engine"`). The fast loop: -m "not ranks and not vllm".

RANK_POOL_FIXTURES = {"ranks", "ranks2", "ranks4", "vllm_ranks", "vllm_v2_ranks", "gpu_ranks"}


def _slow_selected(config) -> bool:
    """`-m` names slow (`-m slow`, `-m "slow and engine"`, `-m "not slow"`)."""
    return re.search(r"\bslow\b", config.getoption("markexpr") or "") is not None


# --- pytest-xdist: two workers, a group per worker at a time ---------------------------

# The tests marked `vllm` share one group, run by one worker in file order: one import
# of vLLM, one vLLM rank pool, and the spec-decoding run that test_vllm_spec_decode.py
# reads (one SpecDecodeRun a worker), started by the group's first test. vllm(group=
# "module") keeps a test in its module's group, off that chain, the suite's longest:
# Model Runner V2's modules (each with a vLLM pool of its own) and tests that only
# register vLLM's ops. Every other module is a group of its own, so its module fixtures
# run once.


def _group(item) -> str:
    mark = item.get_closest_marker("vllm")
    if mark is not None and mark.kwargs.get("group", "vllm") == "vllm":
        return "vllm"
    return item.path.stem


def pytest_itemcollected(item):
    """The ranks mark and the group mark, set as each test is collected: pytest-xdist's
    loadgroup reads the group in its own collection hook, which runs before this
    conftest's (pytest 9.2 breaks that reading, hence pyproject's pin)."""
    if RANK_POOL_FIXTURES & set(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.ranks)
    item.add_marker(pytest.mark.xdist_group(_group(item)))


def pytest_collection_modifyitems(config, items):
    """`slow` tests deselected unless `-m` names slow; then the order the workers take
    the groups in (pyproject's addopts keep xdist from reordering): the vLLM group first
    (the longest chain: engine starts), then the groups that start rank processes, most
    rank tests first (the dearest, handed out before a worker could start one when the
    other is nearly done), then the rest in file order."""
    if not _slow_selected(config):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    rank_tests = collections.Counter(_group(item) for item in items
                                     if item.get_closest_marker("ranks"))
    items.sort(key=lambda item: (_group(item) != "vllm", -rank_tests[_group(item)]))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: two workers. More would only add memory (each starts its own rank
    pools): on 2 cores the suite is CPU-bound already at two."""
    return 2
