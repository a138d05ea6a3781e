"""Post-grad graphs in milliseconds, without ranks: what a recognizer sees, built the
way Inductor builds it (functionalization with custom ops under auto_functionalized,
Inductor's decompositions, its joint-graph passes, view -> reshape, its post-grad
passes up to where commfold's pass runs), minus Dynamo. Collectives trace against a
fake process group (no communication), as PyTorch's own micro_pipeline_tp tests do.

    with fake_world(2) as group:
        graph = post_grad(fn, torch.randn(4, 8))
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.joint_graph import joint_graph_passes
from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape
from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx


@contextmanager
def fake_world(world_size: int = 2, rank: int = 0):
    """A default process group of the fake backend (collectives trace, nothing is
    sent); yields the WORLD group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # never replace a real group of the caller
        raise RuntimeError("fake_world: a process group is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class _Reached(Exception):
    """Raised where commfold's pass would run: the graph is what it would get."""


def _stop(graph: fx.Graph) -> None:
    raise _Reached


def post_grad(fn, *args, v2: bool = False, dynamic: bool = False) -> fx.Graph:
    """fn's post-grad graph as commfold's pass receives it (post_grad_custom_post_pass).
    v2: torch's default auto_functionalized_v2 for mutating custom ops (vLLM's
    graphs use v1); dynamic: symbolic sizes (tracing_mode="symbolic")."""
    mode = "symbolic" if dynamic else "fake"
    with inductor_config.patch(enable_auto_functionalized_v2=v2,
                               post_grad_custom_post_pass=_stop), torch.no_grad():
        gm = make_fx(dispatch_functionalize(fn, FunctionalTensorMode()),
                     decomposition_table=select_decomp_table(), tracing_mode=mode)(*args)
        gm.graph.eliminate_dead_code()  # as AOTAutograd's graph is
        joint_graph_passes(gm)
        view_to_reshape(gm)
        try:
            post_grad_passes(gm, is_inference=True)
        except _Reached:
            pass
        else:
            raise AssertionError("post_grad_passes did not reach the custom post pass")
    return gm.graph


def nodes(graph: fx.Graph, target) -> list[fx.Node]:
    """The call_function nodes of target, in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def node(graph: fx.Graph, target) -> fx.Node:
    """The one call_function node of target."""
    found = nodes(graph, target)
    assert len(found) == 1, f"{len(found)} nodes of {target} in\n{graph}"
    return found[0]


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def assert_miss(result, reason: str, node: fx.Node | None = None) -> None:
    """result is a Miss with exactly this reason (and this node, if given)."""
    from commfold.patterns.common import Miss

    assert isinstance(result, Miss), result
    assert result.reason == reason, result.reason
    if node is not None:
        assert result.node is node, (result.node, node)


def vllm_collectives() -> None:
    """Register vLLM's custom-op collectives (torch.ops.vllm.all_reduce, all_gather)
    in this process; skip without vLLM (fail in CI)."""
    from harness.vllm_models import require_vllm

    require_vllm()
    import vllm.distributed.parallel_state  # noqa: F401  (registers torch.ops.vllm.*)


def vllm_ir_ops() -> None:
    """Register vLLM's IR ops (torch.ops.vllm_ir.*); skip without vLLM."""
    from harness.vllm_models import require_vllm

    require_vllm()
    import vllm.ir.ops  # noqa: F401


def vllm_shm_ops() -> None:
    """Load vLLM's kernels the way vLLM does (import_kernels: never `import vllm._C`)
    for torch.ops._C.shm_*; skip where this CPU's build has none (AVX2)."""
    import torch

    from harness.vllm_models import skip_without_shm

    skip_without_shm()
    if not hasattr(torch.ops._C, "shm_allreduce"):
        import pytest

        pytest.skip("vLLM's kernel build here has no shm_allreduce")


def require_vllm_kernels() -> None:
    """Load vLLM's kernels the way vLLM does (current_platform.import_kernels: never
    `import vllm._C`), for its other torch.ops._C ops; skip without vLLM (fail in CI)."""
    from harness.vllm_models import require_vllm

    require_vllm()
    from vllm.platforms import current_platform

    current_platform.import_kernels()
