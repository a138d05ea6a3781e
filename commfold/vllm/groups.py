"""What commfold's ops read of vLLM at run time: its process groups (by name, or by
the handle of their CPU shared-memory communicator) and its FlashInfer fusion's size
table. vLLM is imported inside each function: only a communicator or GPU that is
vLLM's reaches here."""
from __future__ import annotations


def group_named(name: str):
    """vLLM's GroupCoordinator called `name` in this process."""
    from vllm.distributed.parallel_state import _groups

    ref = _groups.get(name)
    group = ref() if ref is not None else None
    if group is None:
        raise RuntimeError(f"commfold: vLLM group {name!r} is not initialized in this process")
    return group


def group_of_shm_handle(handle: int):
    """The vLLM GroupCoordinator whose CPU shared-memory communicator owns `handle`."""
    from vllm.distributed.parallel_state import _groups

    for ref in list(_groups.values()):
        group = ref()
        shm = getattr(getattr(group, "device_communicator", None), "dist_module", None)
        if getattr(shm, "handle", None) == handle:
            return group
    raise RuntimeError(f"commfold: no vLLM group owns shared-memory handle {handle} here")


def flashinfer_fusion_max_mb(capability: int, world: int):
    """vLLM's measured size limit (MB) for its FlashInfer all-reduce fusion on a GPU of
    compute capability `capability` (e.g. 90) at `world` ranks, or None."""
    from vllm.compilation.passes.fusion.allreduce_rms_fusion import (
        FI_ALLREDUCE_FUSION_MAX_SIZE_MB)

    return FI_ALLREDUCE_FUSION_MAX_SIZE_MB.get(capability, {}).get(world)
