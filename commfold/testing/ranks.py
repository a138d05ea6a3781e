"""Run Python functions on N gloo ranks (processes) on 127.0.0.1.

A RankPool keeps its ranks alive between calls, so many test cases share one process
group start-up; a call that fails on any rank, or does not finish within its timeout,
raises RankError carrying each failing rank's traceback, and the pool is shut down
(a rank stuck in a collective cannot be trusted again). ``run_on_ranks`` is the
one-shot form.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A function failed or hung on one or more ranks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, tasks, results, threads):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world_size)
    except Exception:
        results.put((rank, -1, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, fn, args, kwargs = task
        try:
            results.put((rank, call_id, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, call_id, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """`world_size` ranks in one gloo group; ``pool.run(fn, *args)`` runs fn(*args) on
    every rank (fn must be importable: a module-level function) and returns the ranks'
    return values in rank order."""

    def __init__(self, world_size: int, timeout: float = 300.0, threads: int | None = None):
        self.world_size, self.timeout = world_size, timeout
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world_size, port, self._tasks[r], self._results, threads))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._calls = 0

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        if not self.alive:
            raise RankError("rank pool is closed (an earlier call failed or hung)")
        self._calls += 1
        call_id = self._calls
        for q in self._tasks:
            q.put((call_id, fn, args, kwargs))
        deadline = time.monotonic() + (timeout or self.timeout)
        out, failures = {}, {}
        while len(out) + len(failures) < self.world_size:
            left = deadline - time.monotonic()
            if failures:  # the others may be stuck in a collective: give them a moment
                left = min(left, 5.0)
            try:
                rank, cid, ok, value = self._results.get(timeout=max(left, 0.01))
            except queue.Empty:
                break
            if cid not in (call_id, -1):
                continue
            (out if ok else failures)[rank] = value
            if not all(p.is_alive() for p in self._procs) and not failures and len(out) < self.world_size:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                failures.update({r: f"rank {r} process died (exit code {self._procs[r].exitcode})"
                                 for r in dead})
        if failures or len(out) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in out and r not in failures]
            self.close()
            parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items())]
            if missing:
                parts.append(f"--- rank(s) {missing} did not finish within "
                             f"{timeout or self.timeout:.0f}s (hung in a collective?) ---")
            raise RankError(f"{getattr(fn, '__name__', fn)} on {self.world_size} ranks:\n"
                            + "\n".join(parts))
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 300.0, **kwargs) -> list:
    """Start world_size gloo ranks, run fn(*args, **kwargs) on each, stop them."""
    with RankPool(world_size, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)
