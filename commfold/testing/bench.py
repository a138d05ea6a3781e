"""Side-by-side timing for benchmarks: variants interleaved in one run (so machine
noise hits each alike), ranks in step (barrier before each timed call), medians."""
from __future__ import annotations

import statistics
import time

import torch.distributed as dist


def time_side_by_side(variants: dict, args: tuple, iters: int, warmup: int = 3) -> dict:
    """{name: median seconds per call} for each callable in `variants` on `args`."""
    for f in variants.values():  # compile, build caches, warm up
        for _ in range(warmup):
            f(*args)
    times = {k: [] for k in variants}
    for _ in range(iters):
        for k, f in variants.items():
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            f(*args)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
