"""Where the GPU check runs: "cuda", or the CPU when COMMFOLD_GPU_CHECK_DEVICE=cpu (the
same checks on CPU tensors, to prove their code paths on a machine without a GPU),
and the small helpers every check's rank body shares."""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

DEVICE = os.environ.get("COMMFOLD_GPU_CHECK_DEVICE", "cuda")
if DEVICE not in ("cuda", "cpu"):
    raise ValueError(f"COMMFOLD_GPU_CHECK_DEVICE={DEVICE!r}: expected 'cuda' or 'cpu'")

# Every module of the check carries these marks: the `gpu` tier, and without a CUDA GPU
# its tests skip at collection (torch.cuda.is_available() is cheap on a CPU build and
# touches no GPU).
requires_device = [pytest.mark.gpu,
                   pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                      reason="no CUDA GPU")]


def world_comm() -> str:
    """commfold's communicator spec of this rank's default gloo group."""
    import torch.distributed as dist

    return "c10d:" + dist.distributed_c10d._get_default_group().group_name


def rank_device(device: str) -> torch.device:
    """The device this rank computes on (every rank shares GPU 0)."""
    if device == "cuda":
        torch.cuda.set_device(0)
        stage_cuda_all_gather()
        return torch.device("cuda", 0)
    return torch.device("cpu")


_staging = []


def stage_cuda_all_gather() -> None:
    """gloo's all_gather_into_tensor on CUDA tensors killed both ranks (SIGSEGV) on the
    GPU machine's torch 2.11.0+cu130, where its all_reduce on CUDA tensors worked: the
    check stages that one collective through host memory itself, as gloo does for
    all_reduce, with CUDA kernels for the functional op and Inductor's out= form. Only
    the check's rank processes do this; commfold's own code is unchanged (on a GPU it
    runs over NCCL, which cannot put 2 ranks on one GPU)."""
    if _staging:
        return
    f = torch.ops._c10d_functional

    def gather_on_host(x, group_size, group_name):
        return f.wait_tensor(f.all_gather_into_tensor(x.cpu(), group_size, group_name))

    def all_gather(x, group_size, group_name):
        return gather_on_host(x, group_size, group_name).to(x.device)

    def all_gather_out(x, group_size, group_name, *, out):
        return out.copy_(gather_on_host(x, group_size, group_name))

    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", all_gather, "CUDA")
    if hasattr(f, "all_gather_into_tensor_out"):
        lib.impl("all_gather_into_tensor_out", all_gather_out, "CUDA")
    _staging.append(lib)  # the registrations live as long as the library object


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shard_of(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's contiguous last-dim block of `full` (columns divisible by world)."""
    width = full.shape[-1] // world
    return full[..., rank * width:(rank + 1) * width].contiguous()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns as int64, every NaN one value: bitwise comparison, NaN == NaN."""
    b = t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    b = b.to(torch.int64)
    return torch.where(t.isnan(), torch.full_like(b, -1), b)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def ulp(dtype: torch.dtype) -> float:
    """The spacing of `dtype` at 1.0."""
    return torch.finfo(dtype).eps


@contextmanager
def no_cpp_build_off_cpu(device: torch.device):
    """Off the CPU, commfold's C++ vocab scans stay off inside (COMMFOLD_SCAN_KERNELS=0,
    read at each call): a GPU machine then builds no C++ (it may lack a compiler, the
    build would take minutes of the check's five, and a build killed by its time limit
    leaves a lock every later build waits on)."""
    before = os.environ.get("COMMFOLD_SCAN_KERNELS")
    if device.type != "cpu":
        os.environ["COMMFOLD_SCAN_KERNELS"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COMMFOLD_SCAN_KERNELS", None)
        else:
            os.environ["COMMFOLD_SCAN_KERNELS"] = before
