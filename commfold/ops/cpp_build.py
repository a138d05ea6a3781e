"""Build and load commfold's C++ kernels (torch.utils.cpp_extension), safely on any CPU.

Kernels are compiled with ``-march=native`` on the machine that runs them, so the
compiler uses whatever vector units that CPU has (AVX-512, AVX2 + F16C, NEON) and
guards the rest with ``#if defined(__AVX512F__)``-style checks. Built modules are
cached on disk (``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``), which
may be shared between machines - a home directory on NFS, a CI cache. So the build's
name carries a key of everything the binary depends on: the source's hash (with the
local headers it includes), the compiler flags, the CPU's instruction-set features,
where the source lies and the torch it links against. A machine with another CPU
builds its own copy instead of loading one that would die with SIGILL; a second
checkout builds its own copy too (torch's ninja build of one name from another path
rebuilds it, so two checkouts sharing the cache would otherwise rebuild each other's
kernels at every switch), and so does another torch.

``COMMFOLD_PORTABLE_KERNELS=1`` builds for the compiler's default target instead
(no ``-march=native``): slower, loads on any CPU of the architecture.

torch serializes builds of one name with a ``lock`` file in the build directory and
waits, forever, while one exists: a build killed midway (a timed-out test, Ctrl-C)
leaves it behind and every later load hangs. commfold builds under an OS lock of its
own (``flock`` on ``<build dir>.flock``: released by the kernel when its holder dies),
so a ``lock`` file found while holding it was left by a dead build and is removed,
with a line saying so.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import threading
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("commfold")

_lock = threading.Lock()
_loaded: dict[str, object] = {}
_failed: dict[str, str] = {}


@lru_cache(maxsize=1)
def cpu_features() -> str:
    """The CPU's instruction-set features, as the kernel cares about them: the
    architecture plus /proc/cpuinfo's x86 ``flags`` / aarch64 ``Features`` line
    (sorted), or '' where they cannot be read (then builds are portable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return platform.machine() + ":" + " ".join(sorted(value.split()))
    return ""


def arch_flags() -> list[str]:
    """-march=native where the build is keyed on this CPU, else nothing (portable)."""
    if os.environ.get("COMMFOLD_PORTABLE_KERNELS") == "1" or not cpu_features():
        return []
    return ["-march=native"]


def build_key(source: bytes, flags: list[str], features: str, path: str = "",
              torch_version: str = "") -> str:
    """What a built binary depends on, hashed: source, flags, the source's path, the
    torch it links against (torch's ABI changes between releases, and two torch builds
    for one CUDA version share torch's extension directory), and - only for a native
    build - the CPU features it was built for."""
    h = hashlib.sha256(source)
    h.update("\0".join(flags).encode())
    h.update(b"\0" + path.encode())
    h.update(b"\0" + torch_version.encode())
    if "-march=native" in flags:
        h.update(features.encode())
    return h.hexdigest()[:16]


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_bytes(source: Path, seen: set | None = None) -> bytes:
    """The source and the local headers it includes (``#include "x.h"`` beside it,
    recursively): everything of ours the build depends on, for its key."""
    seen = set() if seen is None else seen
    seen.add(source)
    text = source.read_bytes()
    out = [text]
    for name in _LOCAL_INCLUDE.findall(text):
        header = source.parent / name.decode()
        if header.is_file() and header not in seen:
            out.append(source_bytes(header, seen))
    return b"\0".join(out)


def load(name: str, source: Path, defines: dict[str, int] | None = None):
    """The extension built from `source` (one .cpp), or None when it cannot be built
    here (no compiler, a build error: logged once, the caller's fallback runs)."""
    if name in _loaded or name in _failed:
        return _loaded.get(name)
    with _lock:
        if name in _loaded or name in _failed:
            return _loaded.get(name)
        try:
            from torch.utils.cpp_extension import load as cpp_load

            flags = ["-O3", "-fopenmp"] + arch_flags() + [
                f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
            key = build_key(source_bytes(source), flags, cpu_features(),
                            str(Path(source).resolve()), torch.__version__)
            with build_lock(f"{name}_{key}"):
                _loaded[name] = cpp_load(f"{name}_{key}", sources=[str(source)],
                                         extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                         verbose=False)
        except Exception as e:  # no compiler: the composite path still works
            _failed[name] = f"{type(e).__name__}: {e}"
            log.warning("commfold: C++ kernel %s unavailable (%s); using the composite "
                        "path", name, _failed[name])
    return _loaded.get(name)


@contextlib.contextmanager
def build_lock(full_name: str, build_dir: str | None = None):
    """Hold commfold's lock on the build of `full_name` (waits for a live builder);
    inside it, torch's ``lock`` file can only be a dead build's, and is removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock only
        yield
        return
    if build_dir is None:
        from torch.utils import cpp_extension

        build_dir = cpp_extension._get_build_directory(full_name, verbose=False)
    os.makedirs(os.path.dirname(build_dir) or ".", exist_ok=True)
    with open(build_dir + ".flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = Path(build_dir) / "lock"
            if stale.exists():
                log.warning("commfold: removing %s, left by a build that was killed midway "
                            "(no live commfold build holds it)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
