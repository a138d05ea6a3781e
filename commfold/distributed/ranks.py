"""Run Python functions on N gloo ranks (processes) on 127.0.0.1.

A RankPool keeps its ranks alive between calls, so many test cases share one process
group start-up. A call that fails on any rank, whose rank process dies (a signal, an
abort in C++, ``os._exit``), or that does not finish within its timeout raises
RankError carrying each failing rank's traceback - or, for a dead rank, its exit code,
signal and the tail of what it wrote to stderr - root causes first, the ranks that only
lost a peer last; and the pool is shut down (a rank stuck in a collective cannot be
trusted again). A dead rank fails the call within about a second, not after the
timeout. ``run_on_ranks`` is the one-shot form.

Each rank's stderr goes through a pipe to this process: it is copied to this
process's ``sys.stderr`` as it arrives, and its last lines are kept for the error.

Ranks are forked from a forkserver that imported torch, Inductor and commfold once
(~7 s of imports per rank otherwise, the most of a small pool's start-up), as long as
this process's environment is the one that server started with: import-time settings
(TORCHINDUCTOR_*, TORCH_LOGS, ...) then match. Otherwise, and where the platform has
no forkserver, ranks are spawned as before; ``RankPool.spawn_reason`` says why (also
logged at INFO), and ``environment_kept()`` keeps a passing change from costing that.

Ranks that compile the same graph lower it once between them
(commfold.distributed.compile_once: the first holds a lock on the graph's FX cache key,
the others then load its result from Inductor's cache), about half the CPU time of a
multi-rank compile. ``compile_once=False`` keeps every rank lowering its own.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback

import multiprocessing
import multiprocessing.forkserver

import torch.multiprocessing as mp

# After a rank died or failed, how long the others get to report (they may be stuck
# in a collective with the dead rank, or fail fast with a connection error).
_GRACE_S = 1.0
_POLL_S = 0.1  # how often a waiting call checks that every rank is alive
_TAIL_LINES = 30


# What a forkserver imports once, before it forks any rank: what every rank imports
_PRELOAD = ["torch", "torch.distributed", "torch._inductor.compile_fx", "commfold"]
# Environment variables that change while a process runs without changing any
# import-time setting (pytest's name of the running test)
_VOLATILE_ENV = {"PYTEST_CURRENT_TEST"}
_forkserver: dict = {}  # the forkserver commfold started: its pid and environment
_log = logging.getLogger(__name__)


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}


def _changed(before: dict, now: dict) -> str:
    """'A, B set; C changed; D unset' (names only: values may be secrets)."""
    groups = {"set": now.keys() - before.keys(),
              "changed": {k for k in before.keys() & now.keys() if before[k] != now[k]},
              "unset": before.keys() - now.keys()}
    return "; ".join(f"{', '.join(sorted(names))} {what}"
                     for what, names in groups.items() if names)


def _context():
    """(context, why spawned): the forkserver context and None when its server is
    commfold's (preloaded) and started in this environment; the spawn context and the
    reason otherwise."""
    try:
        if "forkserver" not in multiprocessing.get_all_start_methods():
            return mp.get_context("spawn"), "this platform has no forkserver"
        server = multiprocessing.forkserver._forkserver
        pid = getattr(server, "_forkserver_pid", None)
        if not _forkserver and pid is not None:  # someone else's server: unknown imports
            return mp.get_context("spawn"), "a forkserver not started by commfold runs here"
        if not _forkserver:
            multiprocessing.set_forkserver_preload(_PRELOAD)
        server.ensure_running()  # starts it, or restarts it if it died
        env = _environment()
        if server._forkserver_pid != _forkserver.get("pid"):  # started now, here
            _forkserver.update(pid=server._forkserver_pid, env=env)
        if _forkserver["env"] != env:
            return mp.get_context("spawn"), (
                "the environment changed since commfold's forkserver started ("
                + _changed(_forkserver["env"], env) + ")")
        return mp.get_context("forkserver"), None
    except Exception as e:  # noqa: BLE001 - no fast start, never a failed pool
        return mp.get_context("spawn"), f"the forkserver did not start: {e!r}"


@contextlib.contextmanager
def environment_kept():
    """On exit, os.environ is again what it was on entry (volatile variables aside), so
    pools started afterwards still fork from the server: for code that sets variables
    for a while (a test, a library that sets some when imported)."""
    before = _environment()
    try:
        yield
    finally:
        for k in [k for k in os.environ if k not in _VOLATILE_ENV and k not in before]:
            del os.environ[k]
        os.environ.update(before)


def start_forkserver() -> str:
    """Start commfold's preloaded forkserver now, in this environment, and say which
    start method pools will use ("forkserver", or "spawn" where there is none or
    another one runs). Pools fork from it while the environment stays the one it
    started in: a process that changes its environment for a while (a test, a library
    setting variables at import) calls this first, and makes the change inside
    ``environment_kept()``."""
    return _context()[0].get_start_method()


class RankError(RuntimeError):
    """A function failed, hung or died on one or more ranks."""


# What gloo says on the ranks left in a collective when a peer died or dropped out
_PEER_LEFT = ("Connection closed by peer", "Connection reset by peer", "Socket closed")


def peer_left(failure: str) -> bool:
    """Whether a rank's failure text says only that a peer left its collective (a
    consequence of another rank's failure, not a cause)."""
    return any(s in failure for s in _PEER_LEFT)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, tasks, results, threads, compile_once, stderr_pipe):
    os.dup2(stderr_pipe.fileno(), 2)  # everything this rank writes to fd 2, C++ included
    stderr_pipe.close()
    import faulthandler

    faulthandler.enable()  # a fatal signal prints the Python stack into that pipe

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if compile_once:
        from commfold.distributed.compile_once import install

        install()
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


class _StderrTail:
    """Reads one rank's stderr pipe in a daemon thread: copies it to this process's
    sys.stderr and keeps the last lines. EOF comes when the rank exits (or dies)."""

    def __init__(self, conn):
        self._conn = conn
        self._lines: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._partial = ""
        self._done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        fd = self._conn.fileno()
        try:
            while chunk := os.read(fd, 65536):
                text = chunk.decode(errors="replace")
                try:
                    sys.stderr.write(text)
                    sys.stderr.flush()
                except Exception:
                    pass
                *whole, self._partial = (self._partial + text).split("\n")
                self._lines.extend(whole)
        except OSError:
            pass
        finally:
            if self._partial:
                self._lines.append(self._partial)
            self._conn.close()
            self._done.set()

    def tail(self, wait: float = 0.5) -> str:
        """The last lines written (waits briefly for EOF: a dead rank's last words)."""
        self._done.wait(wait)
        return "\n".join(self._lines)


def describe_exit(exitcode: int | None) -> str:
    """'SIGILL (exit code -4)' / 'exit code 3' / 'still running'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"{signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"signal {-exitcode} (exit code {exitcode})"
    return f"exit code {exitcode}"


class RankPool:
    """`world_size` ranks in one gloo group; ``pool.run(fn, *args)`` runs fn(*args) on
    every rank (fn must be importable: a module-level function) and returns the ranks'
    return values in rank order. With `compile_once` (the default) the ranks lower a
    graph they all compile once between them, through Inductor's FX graph cache
    (commfold.distributed.compile_once); False: every rank lowers its own. ``spawn=True`` starts
    every rank in a fresh interpreter, never forked: for ranks that use a CUDA GPU, whose
    driver must not have been touched before a fork (by imports the forkserver made).
    ``env`` (with spawn=True): variables the spawned ranks start with, set in this
    process only while they start (for what a library reads at import)."""

    def __init__(self, world_size: int, timeout: float = 300.0, threads: int | None = None,
                 compile_once: bool = True, spawn: bool = False,
                 env: dict[str, str] | None = None):
        if env and not spawn:
            raise ValueError("RankPool(env=...) needs spawn=True: forked ranks inherit "
                             "the forkserver's environment")
        self.world_size, self.timeout = world_size, timeout
        ctx, self.spawn_reason = ((mp.get_context("spawn"), "spawn=True") if spawn
                                  else _context())  # why ranks are spawned; None: forked
        self.start_method = ctx.get_start_method()  # "forkserver" or "spawn"
        if self.spawn_reason:
            _log.info("rank pool spawns its ranks (~10 s of imports each): %s",
                      self.spawn_reason)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        port = free_port()
        self._procs, self._stderr = [], []
        with environment(env or {}):
            self._start(ctx, world_size, port, threads, compile_once)
        self._calls = 0

    def _start(self, ctx, world_size, port, threads, compile_once):
        for r in range(world_size):
            read_end, write_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, daemon=True,
                            args=(r, world_size, port, self._tasks[r], self._results,
                                  threads, compile_once, write_end))
            p.start()
            write_end.close()  # the rank holds the only write end: EOF when it exits
            self._procs.append(p)
            self._stderr.append(_StderrTail(read_end))

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        if not self.alive:
            raise RankError("rank pool is closed (an earlier call failed, hung or lost a "
                            "rank)")
        self._calls += 1
        call_id = self._calls
        for q in self._tasks:
            q.put((call_id, fn, args, kwargs))
        limit = timeout or self.timeout
        deadline = time.monotonic() + limit
        out, failures = {}, {}
        while len(out) + len(failures) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, cid, ok, value = self._results.get(
                    timeout=min(_POLL_S, deadline - now))
            except queue.Empty:
                pass
            else:
                if cid in (call_id, -1):
                    (out if ok else failures)[rank] = value
            for r, p in enumerate(self._procs):
                if r not in out and r not in failures and p.exitcode is not None:
                    failures[r] = self._death(r)
            if failures:  # the others may be stuck in a collective: give them a moment
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if failures or len(out) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in out and r not in failures]
            self.close()
            # root causes first: a rank whose collective failed only because a peer
            # left (gloo: "Connection closed by peer") is a consequence, listed last
            order = sorted(failures, key=lambda r: (peer_left(failures[r]), r))
            parts = [f"--- rank {r} failed"
                     + (" (a peer left its collective)" if peer_left(failures[r]) else "")
                     + f" ---\n{failures[r]}" for r in order]
            if missing:
                reason = ("stopped waiting after another rank failed" if failures else
                          f"did not finish within {limit:.0f}s (hung in a collective?)")
                parts.append(f"--- rank(s) {missing} {reason} ---")
            raise RankError(f"{getattr(fn, '__name__', fn)} on {self.world_size} ranks:\n"
                            + "\n".join(parts))
        return [out[r] for r in range(self.world_size)]

    def _death(self, rank: int) -> str:
        tail = self._stderr[rank].tail()
        msg = f"rank {rank} died: {describe_exit(self._procs[rank].exitcode)}"
        return msg + (f"\nlast lines of its stderr:\n{tail}" if tail else "")

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


def run_on_ranks(fn, world_size: int, *args, timeout: float = 300.0, compile_once: bool = True,
                 **kwargs) -> list:
    """Start world_size gloo ranks, run fn(*args, **kwargs) on each, stop them."""
    with RankPool(world_size, timeout=timeout, compile_once=compile_once) as pool:
        return pool.run(fn, *args, **kwargs)


def run_here_or_spawn(fn, world_size: int = 2) -> list:
    """Under torchrun or `commfold diff` (RANK set) this process is one rank: join the
    gloo group, run fn(), leave; [fn()]. Otherwise spawn world_size gloo ranks on this
    machine and run fn on each (run_on_ranks): every rank's result."""
    if "RANK" not in os.environ:
        return run_on_ranks(fn, world_size)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return [fn()]
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """os.environ with `env` set (an empty value unsets the variable) inside the
    block, as it was after."""
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
