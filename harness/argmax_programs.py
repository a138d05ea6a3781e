"""Greedy-pick programs over vocab-sharded logits, one per gather spelling, run on
every rank of a pool by tests/test_local_argmax.py. Each takes this rank's logits
shard [rows, Vs] and returns greedy token ids (or (values, ids))."""
from __future__ import annotations

import torch
import torch.distributed as dist

from commfold.cli.demo_model import gather_last_dim


def _world():
    return dist.group.WORLD


def funcol_argmax(shard, vocab, temp):
    full = gather_last_dim(shard, _world())
    return (full[:, :vocab] / temp).argmax(-1)


def inplace_max(shard, vocab, temp):
    w = dist.get_world_size()
    out = torch.empty(w * shard.shape[0], shard.shape[1], dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard)
    full = out.view(w, shard.shape[0], shard.shape[1]).movedim(0, 1).reshape(shard.shape[0], -1)
    return torch.max(full[:, :vocab] * (1.0 / temp), dim=-1).indices


_MESH = None


def setup_mesh():
    """Create the 1-D device mesh outside compiled code (dynamo cannot trace its
    creation in torch 2.13)."""
    global _MESH
    if _MESH is None:
        from torch.distributed.tensor import init_device_mesh

        _MESH = init_device_mesh("cpu", (dist.get_world_size(),))
    return _MESH


def dtensor_topk(shard, vocab, temp):
    from torch.distributed.tensor import DTensor, Shard

    full = DTensor.from_local(shard, _MESH, [Shard(1)], run_check=False).full_tensor()
    scaled = full[:, :vocab] / temp * 2.0  # (a soft cap's tanh is left alone on CPU)
    return torch.topk(scaled, 1, dim=-1).indices.squeeze(-1)


def funcol_max_values(shard, vocab, temp):
    full = gather_last_dim(shard, _world())
    v, i = full[:, :vocab].max(dim=-1, keepdim=True)
    return v, i


def funcol_scaled_in_place(shard, vocab, temp):
    """vLLM's LogitsProcessor spelling: the gathered logits scaled in place."""
    full = gather_last_dim(shard, _world())
    full[:, :vocab] *= 1.0 / temp
    return full[:, :vocab].argmax(-1)


PROGRAMS = {"funcol_argmax": funcol_argmax, "inplace_max": inplace_max,
            "dtensor_topk": dtensor_topk, "funcol_scaled_in_place": funcol_scaled_in_place}


def reference(logits, vocab, temp, name):
    """What each program computes, on the full logits, in eager torch (argmax rule)."""
    x = logits[:, :vocab]
    if name in ("inplace_max", "funcol_scaled_in_place"):
        return torch.max(x * (1.0 / temp), dim=-1).indices
    if name == "dtensor_topk":
        return (x / temp * 2.0).argmax(-1)  # first max; see test docstring
    return (x / temp).argmax(-1)
