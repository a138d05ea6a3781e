"""CUDA: commfold::allreduce_rmsnorm handed to FlashInfer's fused all-reduce +
residual add + RMSNorm (``flashinfer.comm.allreduce_fusion``, pattern
kARResidualRMSNorm: the kernel vLLM's AllReduceFusionPass uses), when FlashInfer is
installed and the call fits it; otherwise the caller takes the composite path.

What decides (shapes, dtypes, the group, the environment: the same on every rank,
so every rank takes the same path and the same collective):
- a CUDA tensor, a c10d or vLLM group of at most 16 ranks;
- no scale on the reduced value (FlashInfer's fusion has none: the scaled overload
  takes the composite path; the pass leaves such sites on these devices unfused);
- x in f32 / bf16 / fp16, the output in x's dtype, the weight (if any) in x's dtype,
  no cast before the weight multiply (FlashInfer normalizes and scales in f32);
  Gemma's ``1 + w`` goes in as ``weight_bias`` when the graph adds it in f32;
- x at most ``max_bytes(world)`` bytes: ``COMMFOLD_FLASHINFER_MAX_BYTES`` if set,
  else vLLM's measured table for this GPU and world size when vLLM is installed,
  else commfold.cost's DEFAULT_FLASHINFER_MAX_BYTES. Larger calls take the composite
  path (NCCL all-reduce + norm);
- ``COMMFOLD_FLASHINFER=0`` turns delegation off.

One workspace per (group, hidden size, dtype), created on first use (a collective
rendezvous, like vLLM's) and kept; a failed creation is logged once and not retried
(the composite path is used from then on).

Verified on CPU only, against a stand-in of flashinfer.comm's API as vLLM 0.32 calls
it (tests/test_flashinfer_norm.py): eligibility, the workspace key and size, the
arguments, and results equal to the composite path. It has not run on a GPU.
"""
from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from functools import cache

import torch

from commfold.cost import DEFAULT_FLASHINFER_MAX_BYTES
from commfold.distributed.collectives import CommKind

log = logging.getLogger("commfold")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICE_TYPES = ("cuda",)  # tests widen this to run the plumbing on CPU tensors
# when vLLM's table (below) has no entry: commfold.cost's default (not measured)
DEFAULT_MAX_BYTES = DEFAULT_FLASHINFER_MAX_BYTES.value
MAX_WORLD = 16

_workspaces: dict = {}
_failed: set = set()
_warned: set = set()


@cache
def flashinfer_comm():
    """flashinfer.comm when it has the unified fusion API, else None (looked up once:
    a failing import on every call would cost more than the call)."""
    try:
        import flashinfer.comm as fi
    except Exception:
        return None
    ok = hasattr(fi, "allreduce_fusion") and hasattr(fi, "create_allreduce_fusion_workspace")
    return fi if ok else None


NO_SCALE = "scaled residual: FlashInfer fusion has no scale"


def why_not(x: torch.Tensor, weight: torch.Tensor | None, weight_offset: float,
            offset_in_weight_dtype: bool, round_before_weight: bool,
            out_dtype: torch.dtype, comm, scaled: bool = False) -> str | None:
    """None when the call can go to FlashInfer, else the reason it cannot."""
    if x.device.type not in DEVICE_TYPES:
        return f"{x.device.type} tensor"
    if os.environ.get("COMMFOLD_FLASHINFER", "1") == "0":
        return "COMMFOLD_FLASHINFER=0"
    if scaled:
        return NO_SCALE
    if comm.kind not in (CommKind.C10D, CommKind.VLLM):
        return f"communicator kind {comm.kind.value!r}"
    if x.dtype not in DTYPES or out_dtype != x.dtype:
        return f"dtype {x.dtype} -> {out_dtype}"
    if weight is not None and weight.dtype != x.dtype:
        return f"weight dtype {weight.dtype} differs from {x.dtype}"
    if weight_offset != 0.0 and offset_in_weight_dtype:
        return "the weight offset is rounded to the weight dtype"
    if round_before_weight:
        return "the graph rounds before the weight multiply"
    if x.dim() == 0 or x.numel() == 0:
        return "empty input"
    world = comm.world_size()
    if world > MAX_WORLD:
        return f"{world} ranks"
    if x.numel() * x.element_size() > max_bytes(world):
        return f"{x.numel() * x.element_size()} bytes > {max_bytes(world)}"
    if flashinfer_comm() is None:
        return "flashinfer.comm (allreduce_fusion) is not installed"
    return None


def max_bytes(world: int) -> int:
    env = os.environ.get("COMMFOLD_FLASHINFER_MAX_BYTES")
    if env:
        return int(env)
    return _vllm_table(world) or DEFAULT_MAX_BYTES


@cache
def _vllm_table(world: int) -> int | None:
    """vLLM's measured size limit (MB) for its FlashInfer fusion on this GPU (looked
    up once per world size: it is on every CUDA call's path)."""
    try:
        major, minor = torch.cuda.get_device_capability()  # no GPU: raises, no vLLM import
        from commfold.vllm.groups import flashinfer_fusion_max_mb

        mb = flashinfer_fusion_max_mb(major * 10 + minor, world)
    except Exception:
        return None
    return int(mb * 2**20) if mb else None


def run(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
        eps: float, weight_offset: float, comm):
    """(normed, new residual) through FlashInfer, or None when its workspace is not
    available (the caller then takes the composite path). Call after why_not."""
    fi = flashinfer_comm()
    hidden = x.shape[-1]
    ws = _workspace(fi, comm, hidden, x.dtype, x.device)
    if ws is None:
        return None
    rows = x.reshape(-1, hidden).contiguous()
    res = (residual.reshape(-1, hidden).contiguous() if residual is not None
           else torch.zeros_like(rows))  # h = sum + 0: the reduced value itself
    gamma = weight.reshape(-1).contiguous() if weight is not None else \
        torch.ones(hidden, dtype=x.dtype, device=x.device)
    h, out = torch.empty_like(rows), torch.empty_like(rows)
    fi.allreduce_fusion(
        input=rows, workspace=ws, pattern=fi.AllReduceFusionPattern.kARResidualRMSNorm,
        launch_with_pdl=False, output=None, residual_out=h, norm_out=out,
        residual_in=res, rms_gamma=gamma, rms_eps=float(eps), use_oneshot=None,
        fp32_acc=True, weight_bias=float(weight_offset))
    return out.view(x.shape), h.view(x.shape)


def _workspace(fi, comm, hidden: int, dtype: torch.dtype, device):
    key = (comm.spec, hidden, dtype)
    if key in _workspaces:
        return _workspaces[key]
    if key in _failed:
        return None
    world, rank = comm.world_size(), comm.rank()
    max_tokens = max(1, max_bytes(world) // (hidden * torch.empty((), dtype=dtype).element_size()))
    try:
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            ws = fi.create_allreduce_fusion_workspace(
                backend="trtllm", world_size=world, rank=rank, max_token_num=max_tokens,
                hidden_dim=hidden, dtype=dtype, group=_process_group(comm))
    except Exception as e:
        _failed.add(key)
        log.warning("commfold: FlashInfer all-reduce workspace for %s (hidden %d, %s) "
                    "failed (%s); using the composite path (NCCL all-reduce, then the "
                    "norm). Set COMMFOLD_FLASHINFER=0 to skip the attempt.",
                    comm.spec, hidden, dtype, e)
        return None
    _workspaces[key] = ws
    return ws


def _process_group(comm):
    from commfold.distributed.collectives import _c10d_group, _vllm_group

    if comm.kind is CommKind.C10D:
        return _c10d_group(comm.name)
    return _vllm_group(comm.name).cpu_group  # as vLLM creates its own workspace


def try_run(x, residual, weight, eps, weight_offset, offset_in_weight_dtype,
            round_before_weight, out_dtype, comm, scaled: bool = False):
    """(normed, new residual) through FlashInfer, or None (the reason is logged once)."""
    why = why_not(x, weight, weight_offset, offset_in_weight_dtype, round_before_weight,
                  out_dtype, comm, scaled)
    done = run(x, residual, weight, eps, weight_offset, comm) if why is None else None
    if done is None:
        why = why or "no FlashInfer workspace"
        if why not in _warned:
            _warned.add(why)
            log.info("commfold: allreduce_rmsnorm on %s without FlashInfer: %s",
                     x.device.type, why)
    return done
