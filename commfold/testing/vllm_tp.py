"""vLLM's own TP group inside rank-pool processes (tests and benchmarks), so graphs
use vLLM's collectives: vLLM CPU's shared-memory communicator or its gloo fallback."""
from __future__ import annotations

import os

_config_ctx = None


def init_vllm_tp(world_size: int, shm: bool = True):
    """In a rank-pool process (default gloo group already up): vLLM's world and TP
    groups. shm=True gives vLLM CPU's default shared-memory communicator (all ranks
    share one VLLM_DIST_IDENT); shm=False makes the idents differ, so vLLM falls back
    to torch.distributed (gloo). Re-initializes if called again."""
    import torch.distributed as dist
    import vllm._C  # noqa: F401  (registers the shm ops the CPU communicator checks for)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    global _config_ctx
    rank = dist.get_rank()
    ident = f"commfold-test-{os.environ['MASTER_PORT']}"
    os.environ["VLLM_DIST_IDENT"] = ident if shm else f"{ident}-rank{rank}"
    if _config_ctx is None:
        _config_ctx = set_current_vllm_config(VllmConfig())
        _config_ctx.__enter__()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                    backend="gloo")
    ps.initialize_model_parallel(world_size)
    return ps.get_tp_group()


def shm_handle(tp) -> int:
    """The shared-memory handle of a vLLM CPU TP group (what _C.shm_* ops take)."""
    return tp.device_communicator.dist_module.handle
