"""All-reduces, in every spelling commfold knows, as one typed match:

1. c10d functional (funcol.all_reduce, in-place dist.all_reduce, DTensor Partial ->
   Replicate): ``_c10d_functional.all_reduce(x, op, group)`` -> ``wait_tensor`` (a
   user's explicit wait adds a second one). In-place dist.all_reduce on a graph
   input adds an ``aten.copy_(input, reduced)`` write-back: an ordinary consumer of
   the reduced value here.
2. vLLM custom-op collectives: ``torch.ops.vllm.all_reduce(x, group)``.
3. vLLM CPU shared memory: ``auto_functionalized(_C.shm_allreduce, handle=h,
   data=x)`` -> ``getitem(., 1)`` (vLLM's graphs), or torch's default
   ``auto_functionalized_v2(..., _data_base_index=0, _all_bases=[x])`` ->
   ``getitem(., 1)`` when x is a whole tensor (not a view of one).
vLLM's ops are looked up by name and only when registered (commfold never imports
vLLM).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch.fx as fx

from commfold.distributed.collectives import CommKind
from commfold.fx.nodes import is_call, is_getitem, operands

from .common import (Miss, Verdict, c10d, functional_kwargs, is_functionalized, optional_op,
                     waits_of)


@final
@dataclass(frozen=True)
class AllReduce:
    """`reduced` holds the `reduce_op` ('sum', 'avg', ...) of every rank's `input`."""

    input: fx.Node
    reduced: fx.Node
    reduce_op: str
    comm: str  # communicator spec (commfold.distributed.collectives)
    collective: fx.Node
    comm_nodes: tuple[fx.Node, ...]  # the collective and its waits: erased with it


def allreduce_candidates(graph: fx.Graph) -> list[fx.Node]:
    """Collective nodes that all-reduce, in graph order."""
    vllm_ar, shm_ar = optional_op("vllm", "all_reduce"), optional_op("_C", "shm_allreduce")
    targets = {c10d.all_reduce.default} | ({vllm_ar} if vllm_ar else set())
    return [n for n in graph.nodes if n.op == "call_function" and (
        n.target in targets or is_functionalized(n, shm_ar))]


def match_allreduce(coll: fx.Node) -> Verdict[AllReduce]:
    if is_call(coll, c10d.all_reduce.default):
        x, op, group = operands(coll)[:3]
        waits = waits_of(coll)
        if not waits:
            return Miss("all-reduce without a wait_tensor", coll)
        return AllReduce(x, waits[-1], str(op), CommKind.C10D.spec(group), coll,
                         (coll, *waits))
    vllm_ar = optional_op("vllm", "all_reduce")
    if vllm_ar is not None and is_call(coll, vllm_ar):
        x, group = operands(coll)[:2]
        return AllReduce(x, coll, "sum", CommKind.VLLM.spec(group), coll, (coll,))
    if is_functionalized(coll, optional_op("_C", "shm_allreduce")):
        outs = [u for u in coll.users if is_getitem(u, 1)]
        if len(outs) != 1 or len(coll.users) != 1:
            return Miss("shm all-reduce result read other than through one getitem", coll)
        handle = coll.kwargs.get("handle")
        if not isinstance(handle, int):
            return Miss("shm all-reduce handle is not a constant", coll)
        data = (functional_kwargs(coll) or {}).get("data")
        if data is None:
            return Miss("shm all-reduce on a view of a larger tensor (auto_functionalized_v2)",
                        coll)
        return AllReduce(data, outs[0], "sum", CommKind.VLLM_SHM.spec(handle), coll,
                         (coll, outs[0]))
    return Miss("not an all-reduce spelling commfold knows", coll)
