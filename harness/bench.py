"""Side-by-side timing for benchmarks: variants interleaved in one run (so machine
noise hits each alike), ranks in step (barrier before each timed call), medians; and
the communication one call really runs (record_collectives), for comparison with
the lower bound of the rewritten form."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from commfold.distributed.comm_log import record_collectives

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


def paired_rounds(variants: dict, args: tuple, rounds: int, block_s: float = 20e-3,
                  max_block: int = 40, warmup: int = 3) -> dict:
    """{name: [seconds per call, one value per round]} for latency-bound collectives,
    where single calls on a shared CPU scatter by +-30%: each round times a block of
    back-to-back calls of every variant (about `block_s` long, the same count on every
    rank), in round_order (every variant in every position equally often), and a
    block's time is its slowest rank's (a collective ends when its last rank does).
    Compare variants round by round (paired_ratio): machine drift cancels."""
    for f in variants.values():
        for _ in range(warmup):
            f(*args)
    names = list(variants)
    t0 = time.perf_counter()
    variants[names[0]](*args)
    block = _all_ranks_max(time.perf_counter() - t0)  # one count on every rank
    block = max(1, min(max_block, int(block_s / max(block, 1e-9))))
    times = {k: [] for k in names}
    for i in range(max(rounds, MIN_ITERS)):
        for k in round_order(names, i):
            f = variants[k]
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(block):
                f(*args)
            times[k].append(_all_ranks_max((time.perf_counter() - t0) / block))
    return times


def round_order(names: list, i: int) -> list:
    """Round i's order: the rotations of `names`, each forwards then backwards. Over
    2 * len(names) rounds every variant runs in every position equally often (plain
    reversal every other round left a middle variant never first or last)."""
    n = len(names)
    order = names[i % n:] + names[:i % n]
    return order if (i // n) % 2 == 0 else order[::-1]


def paired_ratio(times: dict, base: str, other: str) -> dict:
    """Median and quartiles over rounds of base / other (> 1: other is faster)."""
    r = sorted(a / b for a, b in zip(times[base], times[other]))
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return {"median": statistics.median(r), "q1": q[0], "q3": q[2], "rounds": len(r)}


def _all_ranks_max(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def comm_of(fn, args: tuple) -> dict:
    """The collectives one call fn(*args) ran on this rank: {"bytes": what this rank
    put into them, "calls": how many}. Call it after a warm-up (steady state)."""
    with record_collectives() as log:
        fn(*args)
    return {"bytes": log.bytes(), "calls": log.calls()}


def comm_of_variants(variants: dict, args: tuple) -> dict:
    """comm_of for each variant: {name: {"bytes", "calls"}}."""
    return {k: comm_of(f, args) for k, f in variants.items()}


def read_and_gather(shard: torch.Tensor, row_bytes: int):
    """The machine's floor for a local pick over `shard`, as a callable: one read of
    the shard (``sum``) and one all-gather of `row_bytes` per row - what any rewritten
    form must at least do. Timed side by side with it, a variant's ratio to this
    says how far from the limit it is."""
    rows = shard.reshape(-1, shard.shape[-1]).shape[0]
    send = torch.zeros(rows, -(-row_bytes // 8), dtype=torch.int64)
    out = torch.empty(dist.get_world_size() * rows, send.shape[1], dtype=torch.int64)

    def floor(_shard):
        _shard.sum()
        dist.all_gather_into_tensor(out, send)

    return floor


def floor_table(rows: list[dict], case_keys: list[str], same: str = "same"):
    """A benchmark's markdown table against the machine's floor (read_and_gather): the
    case columns, both timings and the speed-up, the floor and each variant over it,
    whether the results agree, and the bytes each rank sent vs the lower bound."""
    cols = [*case_keys, "Inductor (ms)", "commfold (ms)", "speed-up", "floor (ms)",
            "commfold / floor", "Inductor / floor", same, "bytes/rank: Inductor", "commfold",
            "bound"]
    yield "| " + " | ".join(cols) + " |"
    yield "|" + "---|" * len(cols)
    for r in rows:
        ind, ours, floor = r["inductor_s"], r["commfold_s"], r["floor_s"]
        cells = [*(r[k] for k in case_keys), f"{ind * 1e3:.3f}", f"{ours * 1e3:.3f}",
                 f"{ind / ours:.2f}x", f"{floor * 1e3:.3f}", f"{ours / floor:.2f}x",
                 f"{ind / floor:.1f}x", r["same"],
                 *(r["comm"][v]["bytes"] for v in ("inductor", "commfold", "bound"))]
        yield "| " + " | ".join(map(str, cells)) + " |"
