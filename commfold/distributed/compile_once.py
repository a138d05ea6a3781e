"""Ranks on one machine lower a graph they share once. N ranks compiling the same graph
at the same moment all miss Inductor's FX graph cache, and each lowers it: seconds of
Python work per graph and rank (Inductor already builds each C++ kernel once, under a
file lock). With this installed in each rank, the first rank to reach a cache key
holds a file lock on it until its compile is saved; the others wait, then load the
compile from the cache, as any later run would. A hit serves what the same key
(graph, inputs, config, commfold's pass uuid) compiles to, so results are unchanged,
and commfold's report for it is republished (report_cache.py). Graphs that differ
between ranks (a rank's vocab offset baked in) have different keys: each rank still
lowers its own. With the FX graph cache off nothing is locked.

Wraps two private Inductor entry points (FxGraphCache.prepare_key, called only by
compile_fx._compile_fx_inner, which releases the lock however it ends); where they are
missing nothing is installed and ranks compile as before."""
from __future__ import annotations

import os
import threading

_WAIT_S = 600.0  # a rank waits this long at most for another's compile, then compiles
_held = threading.local()


def held_locks() -> list:
    """This thread's locks, taken by a cache key and not yet released."""
    if not hasattr(_held, "locks"):
        _held.locks = []
    return _held.locks


def installed() -> bool:
    from torch._inductor import compile_fx

    return getattr(compile_fx._compile_fx_inner, "_commfold_compile_once", False)


def install() -> bool:
    """Wrap Inductor's cache key and inner compile, once per process; True when
    installed."""
    try:
        from torch._inductor import codecache, compile_fx

        prepare_key = codecache.FxGraphCache.prepare_key
        inner = compile_fx._compile_fx_inner
    except (ImportError, AttributeError):
        return False
    if installed():
        return True

    def prepare_key_then_lock(*args, **kwargs):
        key_info, cache_info = prepare_key(*args, **kwargs)
        if key_info is not None:
            _lock(codecache.get_lock_dir(), key_info[0])
        return key_info, cache_info

    def compile_then_release(*args, **kwargs):
        depth = len(held_locks())
        try:
            return inner(*args, **kwargs)
        finally:
            while len(held_locks()) > depth:
                held_locks().pop().release()

    compile_then_release._commfold_compile_once = True
    codecache.FxGraphCache.prepare_key = staticmethod(prepare_key_then_lock)
    compile_fx._compile_fx_inner = compile_then_release
    return True


def _lock(lock_dir: str, key: str) -> None:
    from filelock import FileLock, Timeout  # a dependency of torch

    lock = FileLock(os.path.join(lock_dir, f"commfold-graph-{key}.lock"))
    try:
        lock.acquire(timeout=_WAIT_S)
    except Timeout:
        return  # compile it here, as without this module
    held_locks().append(lock)
