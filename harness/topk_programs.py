"""Top-k programs over vocab-sharded logits, one per gather spelling, run on every
rank of a pool by tests/test_local_topk.py. Each takes this rank's logits shard
[rows, Vs] and returns (values, token ids) of the k largest scaled logits of the
valid vocab."""
from __future__ import annotations

import torch
import torch.distributed as dist

from commfold.cli.demo_model import gather_last_dim
from harness import argmax_programs
from harness.argmax_programs import setup_mesh  # noqa: F401  (re-exported: DTensor programs need the mesh)


def _world():
    return dist.group.WORLD


def funcol_topk(shard, vocab, temp, k):
    full = gather_last_dim(shard, _world())
    v, i = torch.topk(full[:, :vocab] / temp, k, dim=-1)
    return v, i


def inplace_sort(shard, vocab, temp, k):
    w = dist.get_world_size()
    out = torch.empty(w * shard.shape[0], shard.shape[1], dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard)
    full = out.view(w, shard.shape[0], shard.shape[1]).movedim(0, 1).reshape(shard.shape[0], -1)
    v, i = torch.sort(full[:, :vocab] * (1.0 / temp), dim=-1, descending=True, stable=True)
    return v[:, :k], i[:, :k]


def dtensor_topk(shard, vocab, temp, k):
    from torch.distributed.tensor import DTensor, Shard

    full = DTensor.from_local(shard, argmax_programs._MESH, [Shard(1)],
                              run_check=False).full_tensor()
    out = (full[:, :vocab] / temp).topk(k, sorted=False)  # order unspecified: any is fine
    return out.values, out.indices


PROGRAMS = {"funcol_topk": funcol_topk, "inplace_sort": inplace_sort,
            "dtensor_topk": dtensor_topk}


def scaled(logits, vocab, temp, name):
    """The values each program ranks, on the full logits, in eager torch."""
    x = logits[:, :vocab]
    return x * (1.0 / temp) if name == "inplace_sort" else x / temp


def reference(logits, vocab, temp, name, k):
    """commfold's promise: the stable descending sort's first k (ties lowest index
    first, NaN largest)."""
    v, i = torch.sort(scaled(logits, vocab, temp, name), dim=-1, descending=True, stable=True)
    return v[:, :k], i[:, :k]

