"""Ranks lower a graph they share once (commfold.distributed.compile_once): one rank compiles, the
others wait on the cache key's lock and load its compile from Inductor's cache (the
off switch: test_ranks' start-method test). A failed compile releases the lock."""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

import commfold
from commfold.distributed import compile_once


def compile_at_once(width: int) -> dict:
    """Both ranks compile the same new graph (a never-seen width: a cache miss for the
    first) at the same moment; each compile takes 2 s more, so without the lock both
    would miss. Returns this rank's cache counts, report and result."""
    from torch._dynamo.utils import counters
    from torch._inductor import compile_fx

    lower = compile_fx.fx_codegen_and_compile

    def slow_lower(*args, **kwargs):
        time.sleep(2.0)
        return lower(*args, **kwargs)

    compile_fx.fx_codegen_and_compile = slow_lower
    try:
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(lambda x: (x * 3 + 1).amax(-1), backend=commfold.backend())
        x = torch.arange(2 * width, dtype=torch.float32).reshape(2, width)
        dist.barrier()
        y = fn(x)
    finally:
        compile_fx.fx_codegen_and_compile = lower
    return {"installed": compile_once.installed(), "y": y.tolist(),
            "miss": counters["inductor"]["fxgraph_cache_miss"],
            "hit": counters["inductor"]["fxgraph_cache_hit"],
            "from_cache": commfold.last_report().from_cache}


def test_one_rank_lowers_a_shared_graph(ranks2):
    """Without the lock both ranks miss (each compile is 2 s longer than the gap
    between them); with it one rank lowers, the other loads."""
    width = random.randrange(10_000, 1_000_000)  # a graph no earlier run cached
    per_rank = ranks2.run(compile_at_once, width)
    assert [r["installed"] for r in per_rank] == [True, True]
    assert per_rank[0]["y"] == per_rank[1]["y"] == [3 * width - 2, 6 * width - 2]
    assert sorted(r["miss"] for r in per_rank) == [0, 1], per_rank
    assert sorted(r["hit"] for r in per_rank) == [0, 1], per_rank
    # the rank served from the cache republishes the compiling rank's report
    assert sorted(r["from_cache"] for r in per_rank) == [False, True], per_rank


def test_a_failed_compile_releases_its_lock(monkeypatch):
    from torch._inductor import codecache, compile_fx

    # install() patches these two: restored after the test
    monkeypatch.setattr(codecache.FxGraphCache, "prepare_key",
                        codecache.FxGraphCache.__dict__["prepare_key"])
    monkeypatch.setattr(compile_fx, "_compile_fx_inner", compile_fx._compile_fx_inner)
    assert compile_once.install() and compile_once.installed()
    taken = []
    lock = compile_once._lock
    monkeypatch.setattr(compile_once, "_lock", lambda d, k: (taken.append(k), lock(d, k)))

    def broken(*args, **kwargs):
        raise RuntimeError("lowering failed")

    monkeypatch.setattr(compile_fx, "fx_codegen_and_compile", broken)
    torch._dynamo.reset()
    width = random.randrange(10_000, 1_000_000)
    with pytest.raises(Exception, match="lowering failed"):
        torch.compile(lambda x: x.sin() + 1)(torch.ones(width))
    assert len(taken) == 1 and compile_once.held_locks() == []
    from filelock import FileLock

    free = FileLock(f"{codecache.get_lock_dir()}/commfold-graph-{taken[0]}.lock")
    free.acquire(timeout=0)  # another holder would block: raises Timeout if still held
    free.release()
