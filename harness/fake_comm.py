"""N ranks of a communicator simulated in one process, for the shard math
(commfold.shard) without rank processes or vLLM.

``ranks(world, fn)`` runs ``fn(comm)`` once per rank, each in its own thread, and
returns the results in rank order. A rank's ``all_gather`` waits for every rank's
tensor and returns them concatenated along dim 0 in rank order - what a real
all-gather gives - so code that calls collectives in any sequence runs as on real
ranks. It refuses what a real collective would not take (shapes or dtypes that
differ between ranks) and counts each rank's bytes sent, for checking the byte
formulas against what the math actually sends.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

TIMEOUT_S = 60.0  # a rank that never reaches a collective fails the test, not hangs it


class _Group:
    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=TIMEOUT_S)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.sent = [0] * world  # bytes each rank put into collectives
        self.calls = [0] * world  # collectives each rank called


class FakeComm:
    """One rank's view of a simulated group (commfold.shard.comm.Comm)."""

    def __init__(self, group: _Group, rank: int):
        self._group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def world_size(self) -> int:
        return self._group.world

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        g = self._group
        g.slots[self._rank] = x.detach().contiguous().clone()
        g.sent[self._rank] += x.numel() * x.element_size()
        g.calls[self._rank] += 1
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()  # every rank has read before the next collective writes
        first = parts[0]
        assert first is not None
        for p in parts:
            assert p is not None and p.shape == first.shape and p.dtype == first.dtype, \
                [(q.shape, q.dtype) for q in parts if q is not None]
        return torch.cat([p for p in parts if p is not None])


class Run(list):
    """Each rank's result, in rank order, with what each rank sent."""
    sent: list[int]
    calls: list[int]


def ranks(world: int, fn: Callable[[FakeComm], Any]) -> Run:
    """fn(comm) on `world` simulated ranks at once; their results in rank order. An
    exception on any rank is raised here (the others are released from the barrier)."""
    group = _Group(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            results[rank] = fn(FakeComm(group, rank))
        except threading.BrokenBarrierError:
            pass  # another rank failed: its error is the one raised
        except BaseException as e:  # noqa: B036 - re-raised in the caller's thread
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if group.barrier.broken:
        raise RuntimeError("fake_comm: a rank left a collective unmatched")
    out = Run(results)
    out.sent, out.calls = list(group.sent), list(group.calls)
    return out
