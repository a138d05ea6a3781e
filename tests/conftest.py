"""Shared fixtures: rank pools (2 and 4 gloo ranks; 2 for vLLM), started once per session and
restarted after a failed call (a rank stuck in a collective is not reused); and the
hypothesis profile: derandomized, so every run draws the same examples in the same
time (COMMFOLD_HYPOTHESIS=random draws fresh ones); and which pytest-xdist worker runs
what (pyproject's addopts run every `pytest` on two workers; `-n 0` runs one process)."""
import os

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
          "vllm_v2": (2, {"timeout": 300, "threads": 1, "spawn": True,
                          "env": {"TRITON_INTERPRET": "1"}})}


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


# Rank pools fork their ranks from commfold's preloaded server only while this
# process's environment is the one that server started with (commfold.distributed.ranks); a
# changed one spawns every later pool's ranks (~10 CPU-s of imports a rank). vLLM
# sets variables in the importing process (TORCHINDUCTOR_COMPILE_THREADS, ...; a
# VllmConfig adds VLLM_WORKER_MULTIPROC_METHOD, ...): kept, they made test_ranks cost
# 163 CPU-s instead of 32 on the worker that ran the vLLM modules first.


@pytest.fixture(scope="session", autouse=True)
def _rank_server_started_first():
    """commfold's forkserver starts before the first test, in the session's own
    environment, which every test then leaves as it found it."""
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
def spec_decode_run(tmp_path_factory):
    """The spec-decoding example's run (vllm_models.SpecDecodeRun), started by the
    vLLM group's first test and read by test_vllm_spec_decode.py; killed if still
    running at the end."""
    from harness.vllm_models import SpecDecodeRun

    run = SpecDecodeRun(tmp_path_factory.mktemp("spec"))
    yield run
    run.stop()


@pytest.fixture(autouse=True)
def _spec_decode_started_early(request):
    """The spec-decoding run's engines, the suite's dearest minutes, start in the
    background with the vLLM group's first test, so they overlap the rest of it."""
    if _group(request.node.path.stem) == "vllm" and any(
            item.path.name == "test_vllm_spec_decode.py" for item in request.session.items):
        request.getfixturevalue("spec_decode_run").start()


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()


# --- pytest-xdist: two workers, a module per worker at a time ----------------------

# The vLLM modules share the vLLM rank pool, and their first test starts the
# spec-decoding run that test_vllm_spec_decode.py reads (one SpecDecodeRun a worker):
# one worker runs them all, in file order. Every other module is a group of its own,
# so its module fixtures run once (the V2 and DSpark modules among them, each with a
# vLLM pool of its own: off the vLLM group's chain, the suite's longest).
VLLM_MODULES = {"test_cpu_portability", "test_fuse_vllm_shm", "test_fuse_vllm_spellings",
                "test_vllm_draft_pick", "test_vllm_engine", "test_vllm_families",
                "test_vllm_hook_states",
                "test_vllm_registration", "test_vllm_spec_decode", "test_vllm_target_pick",
                "test_vllm_top_tokens"}
# The longest modules after the vLLM group, longest first (as measured on 2 cores),
# handed out first so that no worker starts one of them when the other is nearly done.
LONG_MODULES = ["test_examples", "test_fuse_allreduce_rmsnorm", "test_cli",
                "test_local_softmax_stats", "test_ranks", "test_bench", "test_backend",
                "test_fuzz", "test_faults", "test_local_topk"]


def _group(stem: str) -> str:
    return "vllm" if stem in VLLM_MODULES else stem


def pytest_itemcollected(item):
    """Group marks, set as each test is collected (pytest-xdist's loadgroup reads them
    after collection; pytest 9.2 breaks that, hence pyproject's pin)."""
    item.add_marker(pytest.mark.xdist_group(_group(item.path.stem)))


def pytest_collection_modifyitems(config, items):
    """The vLLM group first (the longest chain: engine starts), then LONG_MODULES, then
    the rest in file order (pyproject's addopts keep xdist from reordering)."""
    rank = {stem: i for i, stem in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: (_group(item.path.stem) != "vllm",
                                 rank.get(item.path.stem, len(rank))))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: two workers. More would only add memory (each starts its own rank
    pools): on 2 cores the suite is CPU-bound already at two."""
    return 2
