"""All-gathers of a tensor along its last dim (vocab-sharded logits), in every
spelling commfold knows:

1. funcol ``all_gather_tensor(x, -1)`` / DTensor ``Shard(-1) -> Replicate``:
   ``all_gather_into_tensor(x, W, g)`` -> wait -> ``split(., rows)`` -> getitem x W
   -> ``cat([...], -1)``;
2. in-place ``dist.all_gather_into_tensor`` + view/movedim/reshape:
   ... -> wait -> ``reshape([W, *lead, Vs])`` -> ``permute`` (rank dim to -2)
   -> ``clone``? -> ``reshape([*lead, W*Vs])``; with one row (all leading dims 1)
   just ``reshape([*lead, W*Vs])``;
3. vLLM's ``torch.ops.vllm.all_gather(x, -1, W, group)``;
4. vLLM CPU's shared-memory gather on dim 0, functionalized:
   ``auto_functionalized[_v2](_C.shm_all_gather, handle=h, data=x, <output buffer>)``
   -> ``getitem(., 1)`` -> the reshape/permute chain of 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch.fx as fx

from commfold.distributed.collectives import CommKind
from commfold.fx.nodes import (arg, fake_tensor, is_call, is_getitem, ndim, norm_dim, only_user,
                            operands, same_shape)

from .common import Miss, Verdict, aten, c10d, is_functionalized, optional_op, waits_of


@final
@dataclass(frozen=True)
class VocabGather:
    """`gathered` holds the ranks' `shard`s concatenated on the last dim, in rank order."""

    shard: fx.Node
    gathered: fx.Node
    world_size: int
    comm: str  # communicator spec (commfold.distributed.collectives)
    collective: fx.Node
    waits: tuple[fx.Node, ...] = ()

    @property
    def comm_nodes(self) -> tuple[fx.Node, ...]:
        """The collective and its waits: what removing this gather must erase."""
        return (self.collective, *self.waits)


def gather_candidates(graph: fx.Graph) -> list[fx.Node]:
    """Collective nodes that gather tensors (any dim)."""
    vllm_ag, shm_ag = optional_op("vllm", "all_gather"), optional_op("_C", "shm_all_gather")
    targets = {c10d.all_gather_into_tensor.default} | ({vllm_ag} if vllm_ag else set())
    return [n for n in graph.nodes if n.op == "call_function" and (
        n.target in targets or is_functionalized(n, shm_ag))]


def match_vocab_gather(coll: fx.Node) -> Verdict[VocabGather]:
    if is_call(coll, c10d.all_gather_into_tensor.default):
        return _match_c10d(coll)
    vllm_ag = optional_op("vllm", "all_gather")
    if vllm_ag is not None and is_call(coll, vllm_ag):
        return _match_vllm(coll)
    if is_functionalized(coll, optional_op("_C", "shm_all_gather")):
        return _match_shm(coll)
    return Miss("not an all-gather", coll)


def _match_shm(coll: fx.Node) -> Verdict[VocabGather]:
    shard, rank = coll.kwargs.get("data"), None
    if isinstance(shard, fx.Node):
        rank = ndim(shard)
    if rank is None or rank < 2:
        return Miss("gathered tensor is not a [rows..., vocab] tensor", coll)
    outs = [u for u in coll.users if is_getitem(u, 1)]
    if len(outs) != 1 or len(coll.users) != 1:
        return Miss("the gathered buffer has several consumers", coll)
    view = only_user(outs[0])
    if view is None or not is_call(view, aten.reshape.default, aten.view.default):
        return Miss("all-gather on dim 0 (rows), not re-laid on the vocab dim", coll)
    world = operands(view)[1][0]
    if not isinstance(world, int):
        return Miss("gathered buffer viewed other than as [world, *shard]", coll)
    comm = CommKind.VLLM_SHM.spec(coll.kwargs["handle"])
    return _match_reshape_permute(coll, outs, shard, view, world, comm, rank)


def _match_vllm(coll: fx.Node) -> Verdict[VocabGather]:
    shard, dim, world, group = operands(coll)[:4]
    rank = ndim(shard)
    if rank is None or norm_dim(dim, rank) != rank - 1:
        return Miss(f"all-gather on dim {dim}, not the last (vocab) dim", coll)
    return VocabGather(shard, coll, int(world), CommKind.VLLM.spec(group), coll)


def _match_c10d(coll: fx.Node) -> Verdict[VocabGather]:
    shard, world, group = operands(coll)[:3]
    world = int(world)
    rank = ndim(shard)
    if rank is None or rank < 2:
        return Miss("gathered tensor is not a [rows..., vocab] tensor", coll)
    waits = waits_of(coll)
    if not waits:
        return Miss("all-gather without a wait_tensor", coll)
    waited = waits[-1]
    comm = CommKind.C10D.spec(group)
    user = only_user(waited)
    if user is None:
        return Miss("the gathered buffer has several consumers", coll)
    if is_call(user, aten.split.Tensor, aten.split_with_sizes.default):
        return _match_split_cat(coll, waits, shard, user, world, comm, rank)
    if is_call(user, aten.reshape.default, aten.view.default):
        return _match_reshape_permute(coll, waits, shard, user, world, comm, rank)
    return Miss("all-gather on dim 0 (rows), not re-laid on the vocab dim", coll)


def _one_row(shape) -> bool:
    """All leading dims are statically 1: [W, 1.., Vs] and [1.., W*Vs] hold the same
    elements in the same order, so the gather is a plain reshape (DTensor emits it)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return all(statically_known_true(d == 1) for d in shape[:-1])


def _match_split_cat(coll, waits, shard, split, world, comm, rank) -> Verdict[VocabGather]:
    dim = arg(split, "dim")
    getitems = list(split.users)
    if len(getitems) != world or not all(is_getitem(g) for g in getitems):
        return Miss("not every rank's chunk is used", coll)
    if dim != 0 or not all(same_shape(g, shard) for g in getitems):
        return Miss("gathered buffer split other than into per-rank chunks", coll)
    cat = only_user(getitems[0])
    if cat is None or not is_call(cat, aten.cat.default):
        return Miss("per-rank chunks are not concatenated", coll)
    parts = operands(cat)[0]
    cat_dim = arg(cat, "dim")
    if len(parts) != world or any(not is_getitem(p, i) or p.args[0] is not split
                                  for i, p in enumerate(parts)):
        return Miss("per-rank chunks concatenated out of rank order", coll)
    if any(only_user(g) is not cat for g in getitems):
        return Miss("a per-rank chunk has another consumer", coll)
    if norm_dim(cat_dim, rank) != rank - 1:
        return Miss(f"gather on dim {cat_dim}, not the last (vocab) dim", coll)
    return VocabGather(shard, cat, world, comm, coll, tuple(waits))


def _match_reshape_permute(coll, waits, shard, view, world, comm, rank) -> Verdict[VocabGather]:
    shape = list(fake_tensor(shard).shape)
    if _one_row(shape) and same_shape(view, shape[:-1] + [world * shape[-1]]):
        return VocabGather(shard, view, world, comm, coll, tuple(waits))  # 1 row: a plain view
    if not same_shape(view, [world] + shape):
        return Miss("gathered buffer viewed other than as [world, *shard]", coll)
    perm = only_user(view)
    want = list(range(1, rank)) + [0, rank]
    if perm is None or not is_call(perm, aten.permute.default) or list(arg(perm, "dims")) != want:
        return Miss("rank dim is not moved next to the vocab dim", coll)
    nxt = only_user(perm)
    if nxt is not None and is_call(nxt, aten.clone.default):
        nxt = only_user(nxt)
    if nxt is None or not is_call(nxt, aten.reshape.default, aten.view.default,
                                  aten._unsafe_view.default):
        return Miss("rank and vocab dims are not merged", coll)
    if not same_shape(nxt, shape[:-1] + [world * shape[-1]]):
        return Miss("rank and vocab dims are not merged into one vocab dim", coll)
    return VocabGather(shard, nxt, world, comm, coll, tuple(waits))


def after_vocab_gather(match):
    """coll -> match(its VocabGather), for the passes that read what a vocab gather
    feeds; None where coll is no vocab gather (one on another dim: nothing to note)."""
    def matcher(coll: fx.Node):
        gather = match_vocab_gather(coll)
        return match(gather) if gather else None
    return matcher
