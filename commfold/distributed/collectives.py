"""Collective adapters: run a collective on whichever communicator the graph used.

A rewritten graph names its communicator by a spec string ``<kind>:<name>``, taken
from the matched collective, so the fused op talks to the same group the original
program did (the C++ kernel of commfold::allreduce_rmsnorm reads the same specs):

- ``c10d:<group_name>``  torch.distributed (functional collectives, DTensor, dist.*)
- ``vllm:<group_name>``  vLLM's ``torch.ops.vllm.*`` custom-op collectives
- ``vllm_shm:<handle>``  vLLM CPU's shared-memory collectives (``torch.ops._C.shm_*``)
  of the vLLM group that owns that handle
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName


class CommKind(str, Enum):
    """Which library's collectives a communicator spec names."""

    C10D = "c10d"
    VLLM = "vllm"
    VLLM_SHM = "vllm_shm"

    def spec(self, name) -> str:
        """The spec string of this kind's communicator `name` (a group name, a handle)."""
        return f"{self.value}:{name}"


@dataclass(frozen=True)
class Communicator:
    spec: str

    @property
    def kind(self) -> CommKind:
        try:
            return CommKind(self.spec.split(":", 1)[0])
        except ValueError:
            raise ValueError(f"commfold: unknown communicator {self.spec!r}") from None

    @property
    def name(self) -> str:
        return self.spec.split(":", 1)[1]

    def _group(self):
        """torch's ProcessGroup (c10d) or vLLM's GroupCoordinator (vllm, vllm_shm)."""
        kind = self.kind
        if kind is CommKind.C10D:
            return _c10d_group(self.name)
        if kind is CommKind.VLLM:
            return _vllm_group(self.name)
        return _vllm_shm_group(int(self.name))

    def rank(self) -> int:
        group = self._group()
        return group.rank() if self.kind is CommKind.C10D else group.rank_in_group

    def world_size(self) -> int:
        group = self._group()
        return group.size() if self.kind is CommKind.C10D else group.world_size

    def backend(self, device_type: str) -> str | None:
        """The c10d backend that moves device_type tensors for this group ("gloo",
        "nccl", ...); None for vLLM's communicators or when torch cannot say. The same
        on every rank of the group."""
        if self.kind is not CommKind.C10D:
            return None
        try:
            names = str(torch.distributed.get_backend(self._group()))
        except (RuntimeError, ValueError):
            return None
        if ":" not in names:  # one backend for every device ("gloo")
            return names
        by_device = dict(part.split(":", 1) for part in names.split(","))  # "cpu:gloo,cuda:nccl"
        return by_device.get(device_type)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along dim 0, in rank order."""
        world, kind = self.world_size(), self.kind
        if kind is CommKind.C10D:
            f = torch.ops._c10d_functional
            return f.wait_tensor(f.all_gather_into_tensor(x.contiguous(), world, self.name))
        if kind is CommKind.VLLM:
            return torch.ops.vllm.all_gather(x.contiguous(), 0, world, self.name)
        return _shm_all_gather(int(self.name), x, world)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x (out of place)."""
        kind = self.kind
        if kind is CommKind.C10D:
            f = torch.ops._c10d_functional
            return f.wait_tensor(f.all_reduce(x.contiguous(), "sum", self.name))
        if kind is CommKind.VLLM:
            return torch.ops.vllm.all_reduce(x.contiguous(), self.name)
        out = x.clone(memory_format=torch.contiguous_format)  # shm all-reduce: in place
        torch.ops._C.shm_allreduce(int(self.name), out)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's dim-0 chunk of the sum of every rank's x (dim 0 divisible by
        the world size)."""
        world, kind = self.world_size(), self.kind
        if kind is CommKind.C10D:
            f = torch.ops._c10d_functional
            return f.wait_tensor(f.reduce_scatter_tensor(x.contiguous(), "sum", world,
                                                         self.name))
        if kind is CommKind.VLLM:
            return torch.ops.vllm.reduce_scatter(x.contiguous(), 0, world, self.name)
        raise ValueError(f"commfold: no reduce_scatter for communicator {self.spec!r}")


@cache
def communicator(spec: str) -> Communicator:
    return Communicator(spec)


def _c10d_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(cast("GroupName", name))  # the graph's group name


@cache
def _vllm_group(name: str):
    from commfold.vllm.groups import group_named

    return group_named(name)


# shm_all_gather copies bytes but only accepts these dtypes: others travel bit-cast.
_SHM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _shm_all_gather(handle: int, x: torch.Tensor, world: int) -> torch.Tensor:
    x = x.contiguous()
    send = x if x.dtype in _SHM_DTYPES else x.view(torch.float32)
    out = send.new_empty((world * send.shape[0], *send.shape[1:]))
    torch.ops._C.shm_all_gather(handle, send, out)
    return out.view(x.dtype)


def _vllm_shm_group(handle: int):
    """The vLLM GroupCoordinator whose CPU shared-memory communicator owns `handle`
    (handles are per process, so the lookup is not cached across group re-creation)."""
    from commfold.vllm.groups import group_of_shm_handle

    return group_of_shm_handle(handle)
