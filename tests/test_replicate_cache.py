"""The replicated-weight cache in one process: an entry whose shard dies inside a
garbage-collector cycle is evicted, also when the collection runs while the cache's
own lock is held (a GC can start at any allocation, including the cache's own)."""
import gc
import threading

import torch

from commfold.ops import replicate as rep_ops


class _Cycle:
    def __init__(self, shard):
        self.shard, self.me = shard, self


def _cache_entry(shard):
    return rep_ops._full_weight("test", shard, ("layout",), "c10d:unused",
                                lambda _comm, s: s.clone())


def test_entry_of_a_shard_freed_by_gc_under_the_lock_is_evicted():
    gc.collect()
    gc.disable()  # the cycle must die only in the collection below
    try:
        holder = _Cycle(torch.randn(4, 2))
        _cache_entry(holder.shard)
        slots = [k for k in rep_ops._cache if k[0] == "test"]
        assert len(slots) == 1
        del holder  # now only reachable from its own cycle

        def collect_under_lock():
            with rep_ops._lock:  # as when a GC starts inside the cache's locked block
                gc.collect()

        t = threading.Thread(target=collect_under_lock, daemon=True)
        t.start()
        t.join(timeout=10)
        assert not t.is_alive(), "eviction deadlocked on the cache lock"
        assert [k for k in rep_ops._cache if k[0] == "test"] == []
    finally:
        gc.enable()
