"""A stand-in for ``flashinfer.comm``'s unified fusion API, for CPU ranks: the same
entry points and keyword arguments vLLM 0.32 uses, argument checks like
FlashInfer's (2-D contiguous rows, gamma of x's dtype, the pattern), and the
documented result computed with a real gloo all-reduce on the workspace's group.
Every call is recorded, so tests see what commfold handed over."""
from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist


class AllReduceFusionPattern:
    kAllReduce = 0
    kARResidualRMSNorm = 1


class Workspace:
    def __init__(self, **kwargs):
        self.args = kwargs


def install(fail_workspace: bool = False) -> types.SimpleNamespace:
    """Put ``flashinfer`` / ``flashinfer.comm`` into sys.modules (commfold's FlashInfer
    state starts empty); returns the record."""
    _reset_commfold()
    rec = types.SimpleNamespace(workspaces=[], calls=[], attempts=0)

    def create_allreduce_fusion_workspace(*, backend, world_size, rank, max_token_num,
                                          hidden_dim, dtype, group=None, **kwargs):
        rec.attempts += 1
        if fail_workspace:
            raise RuntimeError("no multicast / IPC on this machine (stand-in)")
        ws = Workspace(backend=backend, world_size=world_size, rank=rank,
                       max_token_num=max_token_num, hidden_dim=hidden_dim, dtype=dtype,
                       group=group)
        rec.workspaces.append(ws)
        return ws

    def allreduce_fusion(*, input, workspace, pattern, launch_with_pdl, output=None,
                         residual_out=None, norm_out=None, residual_in=None, rms_gamma=None,
                         rms_eps=1e-6, use_oneshot=None, fp32_acc=False, weight_bias=0.0,
                         **kwargs):
        a = workspace.args
        assert pattern == AllReduceFusionPattern.kARResidualRMSNorm
        assert input.dim() == 2 and input.is_contiguous()
        tokens, hidden = input.shape
        assert hidden == a["hidden_dim"] and tokens <= a["max_token_num"]
        assert input.dtype == a["dtype"] == residual_in.dtype == rms_gamma.dtype
        for t in (residual_in, residual_out, norm_out):
            assert t.shape == input.shape and t.is_contiguous()
        assert rms_gamma.shape == (hidden,)
        rec.calls.append(dict(tokens=tokens, hidden=hidden, dtype=input.dtype,
                              eps=rms_eps, weight_bias=weight_bias, fp32_acc=fp32_acc))
        s = input.float().clone()  # FlashInfer reads input, never writes it
        dist.all_reduce(s, group=a["group"])
        s = s + residual_in.float()
        residual_out.copy_(s)
        n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + rms_eps)
        norm_out.copy_(n * (rms_gamma.float() + weight_bias))
        return norm_out

    comm = types.ModuleType("flashinfer.comm")
    comm.AllReduceFusionPattern = AllReduceFusionPattern
    comm.create_allreduce_fusion_workspace = create_allreduce_fusion_workspace
    comm.allreduce_fusion = allreduce_fusion
    pkg = types.ModuleType("flashinfer")
    pkg.comm = comm
    sys.modules["flashinfer"], sys.modules["flashinfer.comm"] = pkg, comm
    return rec


def _reset_commfold() -> None:
    from commfold.ops import flashinfer_norm

    flashinfer_norm._workspaces.clear()
    flashinfer_norm._failed.clear()
    flashinfer_norm.flashinfer_comm.cache_clear()


def uninstall() -> None:
    sys.modules.pop("flashinfer", None)
    sys.modules.pop("flashinfer.comm", None)
    _reset_commfold()
