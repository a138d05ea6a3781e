"""The CPU kernels of the local selection ops (vocab_scan_cpu.cpp), built once on the
machine that runs them (commfold.ops.cpp_build: cached, keyed on source, flags, CPU).

Each scan reads every logit of a row once, vectorized (AVX-512, AVX2, NEON, scalar)
and split across the rank's threads (rows, and a few long rows into column runs):

- argmax: per lane the first position of its maximum, the first NaN ends the row;
  the first maximum over lanes and runs is torch.argmax's answer (NaN is the maximum,
  the first NaN wins, ties lowest index, -0.0 == +0.0);
- top-k (k <= 64): a vector compare against the running k-th value; the few
  candidates that beat it are kept and cut back to the best k when the buffer fills
  (O(n) whatever the row's order); order = a stable descending sort's;
- softmax statistics: per L1-sized block the maximum (raising the running one and
  rescaling the partial sum once), then sum(exp(x - max)) in float64 from the block:
  one pass over memory for (max, sum of exp, first max).

Loading the module also registers the C++ CPU kernels of commfold::local_argmax,
local_topk and softmax_stats: the scan, one all-gather (c10d groups, vLLM CPU's
shared-memory communicator) and the combine in C++, no Python per call. Anything else
goes to the op's Python implementation (``<op>_eager``): other devices (CUDA), vLLM's
custom-op communicators, float64, empty inputs - or every call, under ``fallback()``
or with ``COMMFOLD_SCAN_KERNELS=0``.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from commfold.ops import cpp_build

SOURCE = Path(__file__).parent / "csrc" / "vocab_scan_cpu.cpp"


def module():
    """The compiled extension, or None where it cannot be built (or is switched off
    with COMMFOLD_SCAN_KERNELS=0)."""
    if os.environ.get("COMMFOLD_SCAN_KERNELS") == "0":
        return None
    return cpp_build.load("commfold_vocab_scan", SOURCE)


def enabled() -> bool:
    """Whether CPU calls of the ops run the C++ kernels now."""
    m = module()
    return m is not None and m.enabled()


@contextmanager
def fallback():
    """Every call of the ops inside runs their torch implementation (tests compare it
    with the C++ kernels)."""
    m = module()
    was = m.enabled() if m is not None else False
    if m is not None:
        m.set_enabled(False)
    try:
        yield
    finally:
        if m is not None:
            m.set_enabled(was)


def note_communicator(c) -> None:
    """Tell the C++ kernels a vLLM shared-memory handle's rank and world (they have no
    other way to learn them); the Python path calls this."""
    if c.kind == "vllm_shm":
        m = module()
        if m is not None:
            m.register_shm(int(c.name), c.rank(), c.world_size())


def register_op(lib, op: str, schema: str, eager, fake) -> None:
    """Define commfold::<op> and its torch twin <op>_eager with one schema and fake:
    <op>'s composite kernel is first_call (the C++ module registers its CPU kernel
    over it once loaded); <op>_eager is the torch implementation, for tests and
    fallbacks. One place for the three scan ops' registration."""
    import torch

    lib.define(op + schema)
    lib.define(f"{op}_eager" + schema)
    lib.impl(f"{op}_eager", eager, "CompositeExplicitAutograd")
    lib.impl(op, lambda tensor, *args: first_call(op, eager, tensor, *args),
             "CompositeExplicitAutograd")
    torch.library.register_fake(f"commfold::{op}", fake)
    torch.library.register_fake(f"commfold::{op}_eager", fake)


def first_call(op: str, eager, tensor, *args):
    """The ops' CompositeExplicitAutograd kernel: on CPU, load the module (one build,
    cached; its CPU kernel then takes every later CPU call) and redispatch."""
    import torch

    if tensor.device.type == "cpu" and module() is not None:
        return getattr(torch.ops.commfold, op).default(tensor, *args)
    return eager(tensor, *args)
