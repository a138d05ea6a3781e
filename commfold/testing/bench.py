"""Side-by-side timing for benchmarks: variants interleaved in one run (so machine
noise hits each alike), ranks in step (barrier before each timed call), medians; and
the communication one call really runs (record_collectives), for comparison with
the lower bound of the rewritten form."""
from __future__ import annotations

import statistics
import time

import torch.distributed as dist

from .comm_log import record_collectives

MIN_ITERS = 5  # medians of fewer calls say little on a shared CPU


def time_side_by_side(variants: dict, args: tuple, iters: int, warmup: int = 3) -> dict:
    """{name: median seconds per call} for each callable in `variants` on `args`."""
    return {k: statistics.median(v)
            for k, v in call_times(variants, args, iters, warmup).items()}


def call_times(variants: dict, args: tuple, iters: int, warmup: int = 3) -> dict:
    """{name: [seconds per call]}: `warmup` calls of each variant (compiles, caches),
    then max(iters, MIN_ITERS) rounds, each calling every variant once after a barrier."""
    for f in variants.values():
        for _ in range(warmup):
            f(*args)
    times = {k: [] for k in variants}
    for _ in range(max(iters, MIN_ITERS)):
        for k, f in variants.items():
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            f(*args)
            times[k].append(time.perf_counter() - t0)
    return times


def comm_of(fn, args: tuple) -> dict:
    """The collectives one call fn(*args) ran on this rank: {"bytes": what this rank
    put into them, "calls": how many}. Call it after a warm-up (steady state)."""
    with record_collectives() as log:
        fn(*args)
    return {"bytes": log.bytes(), "calls": log.calls()}


def comm_of_variants(variants: dict, args: tuple) -> dict:
    """comm_of for each variant: {name: {"bytes", "calls"}}."""
    return {k: comm_of(f, args) for k, f in variants.items()}
