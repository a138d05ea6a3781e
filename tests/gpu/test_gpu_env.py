"""The machine the check ran on, and what everything else stands on: both ranks
compute on the device, and gloo runs the functional collectives commfold's ops and
the compiled programs call (all_reduce, all_gather_into_tensor, reduce_scatter_tensor)
on its tensors, in the dtypes they use."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from gpu_device import DEVICE, rank_device, requires_device

pytestmark = requires_device

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


def collectives_on_rank(device: str) -> dict:
    dev = rank_device(device)
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    failed = []
    for dtype in DTYPES:
        x = (torch.arange(2 * world, device=dev) + 10 * rank).to(dtype)
        want_sum = sum((torch.arange(2 * world) + 10 * r).to(dtype).double() for r in range(world))
        want_cat = torch.cat([(torch.arange(2 * world) + 10 * r).to(dtype) for r in range(world)])
        checks = {
            "all_reduce": lambda x=x, w=want_sum: torch.equal(
                funcol.all_reduce(x, "sum", group).cpu().double(), w),
            "all_gather_into_tensor": lambda x=x, w=want_cat: torch.equal(
                funcol.all_gather_tensor(x, 0, group).cpu(), w),
            "reduce_scatter_tensor": lambda x=x, w=want_sum: torch.equal(
                funcol.reduce_scatter_tensor(x, "sum", 0, group).cpu().double(),
                w.chunk(world)[rank]),
        }
        if dtype == torch.uint8:  # bytes only travel (replicated weights), never summed
            checks = {"all_gather_into_tensor": checks["all_gather_into_tensor"]}
        for name, check in checks.items():
            try:
                ok = check()
            except Exception as e:  # noqa: BLE001 - reported, not raised
                ok = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            if ok is not True:
                failed.append((name, str(dtype), ok))
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    return {"device": str(dev), "name": name, "versions": versions, "failed": failed}


def test_device_and_collectives(gpu_ranks, record_property):
    results = gpu_ranks.run(collectives_on_rank, DEVICE)
    r0 = results[0]
    v = r0["versions"]
    record_property("numbers", f"{r0['name']}; torch {v['torch']}, CUDA {v['cuda']}, triton "
                               f"{v['triton']}; {len(results)} ranks on {r0['device']}, gloo: "
                               f"{len(r0['failed'])} collective/dtype pairs failed"
                               + ("; all_gather staged through host memory by the check "
                                  "(gloo's own segfaulted on torch 2.11+cu130)"
                                  if DEVICE == "cuda" else ""))
    assert all(r["device"] == DEVICE + (":0" if DEVICE == "cuda" else "") for r in results)
    assert all(r["failed"] == [] for r in results), [r["failed"] for r in results]
