"""vLLM's own TP group inside rank-pool processes (tests and benchmarks), so graphs
use vLLM's collectives: vLLM CPU's shared-memory communicator or its gloo fallback.

vLLM's kernels are loaded the way vLLM loads them (``import_kernels()``): on x86 it
picks among three builds by CPU flags, and ``import vllm._C`` on an AVX2-only CPU
dies with SIGILL. Only the AVX-512 builds hold the shared-memory communicator's ops;
on an AVX2-only CPU vLLM runs TP over torch.distributed (gloo), and so do these
groups (``shm_supported()`` says which)."""
from __future__ import annotations

import os

_config_ctx = None


def shm_supported() -> bool:
    """Whether vLLM's kernel build for this CPU has the shared-memory collectives."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, "init_shm_manager")


def _release_onednn_handles_outside_modes() -> None:
    """vLLM CPU's oneDNN matmul handle (``vllm._custom_ops.CPUDNNLGEMMHandler``, made
    for every packed weight) calls ``.item()`` on a tensor in ``__del__``. A rank process
    here builds and drops many vLLM layers; when the garbage collector frees one while
    a torch.compile traces (FakeTensorMode active), that ``.item()`` fails, the error
    message formats the tensor, which calls ``.item()`` again, and the process dies of
    a stack overflow (seen once a dozen suite runs, reproduced by running tests side by
    side). Tests only: the handle is released with the dispatch modes put aside."""
    from torch.utils._python_dispatch import _disable_current_modes
    from vllm import _custom_ops

    handler = getattr(_custom_ops, "CPUDNNLGEMMHandler", None)
    if handler is None or getattr(handler.__del__, "_outside_modes", False):
        return
    release = handler.__del__

    def __del__(self, _release=release):
        with _disable_current_modes():
            _release(self)

    __del__._outside_modes = True
    handler.__del__ = __del__


def init_vllm_tp(world_size: int, shm: bool = True, reuse: bool = False):
    """In a rank-pool process (default gloo group already up): vLLM's world and TP
    groups. shm=True gives vLLM CPU's default shared-memory communicator (all ranks
    share one VLLM_DIST_IDENT; RuntimeError where this CPU's vLLM build has none);
    shm=False makes the idents differ, so vLLM falls back to torch.distributed
    (gloo). Re-initializes if called again, unless reuse=True and the current group
    already has the asked communicator (tests that call this per example).

    vLLM's shared-memory gather (``tp.gather``, which vLLM CPU itself never uses for
    TP: its logits go through all-gather) returns at once on the ranks that send: a
    collective right after it can run two steps ahead of a slow peer, which then
    waits forever in the collective before. Put a barrier after such a gather."""
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if not shm_supported() and shm:  # loads vLLM's kernels either way
        raise RuntimeError(
            "vLLM's kernel build for this CPU has no shared-memory communicator (only its "
            "AVX-512 builds do): vLLM runs TP over gloo here; use shm=False")
    global _config_ctx
    _release_onednn_handles_outside_modes()
    if reuse and ps.model_parallel_is_initialized():
        tp = ps.get_tp_group()
        if tp.world_size == world_size and _has_shm(tp) == shm:
            return tp
    rank = dist.get_rank()
    ident = f"commfold-test-{os.environ['MASTER_PORT']}"
    os.environ["VLLM_DIST_IDENT"] = ident if shm else f"{ident}-rank{rank}"
    if _config_ctx is None:
        _config_ctx = set_current_vllm_config(default_config())
        _config_ctx.__enter__()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                    backend="gloo")
    ps.initialize_model_parallel(world_size)
    return ps.get_tp_group()


def default_config():
    """VllmConfig() - on CPU tensors where vLLM found no platform (a CUDA wheel with no
    GPU: vLLM 0.34's classes in the release tier), whose device it cannot infer."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.platforms import current_platform

    if current_platform.device_type:
        return VllmConfig()
    return VllmConfig(device_config=DeviceConfig(device="cpu"))


def _has_shm(tp) -> bool:
    return getattr(getattr(tp.device_communicator, "dist_module", None), "handle",
                   None) is not None


def shm_handle(tp) -> int:
    """The shared-memory handle of a vLLM CPU TP group (what _C.shm_* ops take)."""
    return tp.device_communicator.dist_module.handle
