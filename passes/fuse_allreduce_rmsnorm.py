"""fuse_allreduce_rmsnorm: a sum all-reduce, the optional residual add and the
RMSNorm after it become one commfold::allreduce_rmsnorm call.

Uses: patterns.allreduce.AllReduce (any spelling: c10d functional, in-place
dist.all_reduce, DTensor, vLLM) and patterns.rmsnorm.RMSNorm (hand-written f32 /
bf16 / fp16, F.rms_norm / nn.RMSNorm, Gemma's 1 + w, no weight, vLLM's f32-sum
fused add + norm, vLLM's IR ops).

Why it is safe:
- the reduction is a sum (others are skipped), and the op runs the graph's own
  collective (same group, through commfold.collectives), so every rank still issues
  exactly one collective here, in the same order as before;
- the op returns the normed output and the new residual (x + residual, or the
  reduced value itself without a residual add); every other reader of those is
  rewired to them (a graph that never computes the new residual, e.g. vLLM's final
  norm, just leaves it unread). A reader of the reduced value before the add would need a value
  the op does not return: skipped;
- the norm's intermediates have no readers outside the norm (the recognizer checks);
- the kernel rounds where the compiled graph would (see commfold.ops.allreduce_rmsnorm);
- the op writes the new residual over its input, but the graph holds it under
  auto_functionalized (functional): Inductor's reinplacing, not this pass, decides
  whether the input's buffer may be reused (it must be dead) or is copied first.
The decision depends on the graph and the config only: rank-consistent.

Writes: auto_functionalized(commfold::allreduce_rmsnorm, x, residual, weight, eps,
offset, flags, comm) -> getitem 0 (normed), getitem 1 (new residual: the op writes it
over x, in place when Inductor's reinplacing finds x dead, into a copy otherwise).
"""
from __future__ import annotations

import operator

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor import config as inductor_config
from torch._inductor.fx_utils import get_node_storage

from commfold.context import PassContext
from commfold.graph import nbytes, tensor_val
from commfold.graph_edit import erase_if_dead, insert_call
from commfold.ops.allreduce_rmsnorm import (SUPPORTED_DTYPES, TWO_SHOT_DEFAULT_MIN_BYTES,
                                           pack_flags)
from commfold.patterns.allreduce import AllReduce, allreduce_candidates, match_allreduce
from commfold.patterns.rmsnorm import match_rmsnorm
from commfold.patterns.rmsnorm_match import RMSNorm
from commfold.report import Comm

PATTERN = "all_reduce->rmsnorm"
TWO_SHOT_OPTION = "allreduce_rmsnorm_two_shot_min_bytes"


def run(ctx: PassContext) -> None:
    two_shot = int(dict(ctx.config.extra).get(TWO_SHOT_OPTION, TWO_SHOT_DEFAULT_MIN_BYTES))
    for ar, norm in ctx.matches(PATTERN, allreduce_candidates(ctx.graph), _allreduce_norm):
        why = _unsafe(ar, norm)
        if why:
            ctx.skipped(PATTERN, norm.output, why)
            continue
        _rewrite(ctx, ar, norm, two_shot)


def _allreduce_norm(coll):
    """(AllReduce, RMSNorm) for coll; None for an unusable all-reduce (e.g. no wait)
    or one no RMSNorm reads (not near-misses); a Miss when the norm almost matches."""
    ar = match_allreduce(coll)
    if not ar:
        return None
    norm = match_rmsnorm(ar.reduced)
    return (ar, norm) if norm else norm


def _unsafe(ar: AllReduce, norm: RMSNorm) -> str | None:
    if ar.reduce_op != "sum":
        return f"'{ar.reduce_op}' all-reduce (only a sum can be fused with the add)"
    dtype = tensor_val(ar.input).dtype
    if dtype not in SUPPORTED_DTYPES or norm.dtype != dtype:
        return f"unsupported dtype {dtype} (norm input {norm.dtype})"
    if norm.residual is not None and len(ar.reduced.users) > 1:
        return "the reduced value is read besides the residual add (the op returns only the sum with the residual)"
    # FX nodes compare by graph position (O(1)): no per-match walk of the graph
    last_input = max(n for n in (ar.collective, norm.residual, norm.weight) if n is not None)
    readers = [u for n in (norm.h, norm.output) if n is not None for u in n.users
               if u not in norm.inner and u is not norm.output]
    if any(not u > last_input for u in readers):
        return "the norm's operands are defined after readers of its result"
    return None


def _rewrite(ctx: PassContext, ar: AllReduce, norm: RMSNorm, two_shot: int) -> None:
    graph = ctx.graph
    # Inductor rounds a low-precision cast inside a kernel only when emulating casts,
    # and a stored buffer always; an eager op (vLLM IR) rounds at every cast: ask the
    # op to round where the unfused program would.
    emulate = bool(inductor_config.emulate_precision_casts) or norm.eager
    anchor = max(n for n in (ar.collective, norm.residual, norm.weight) if n is not None)
    flags = pack_flags(
        offset_in_weight_dtype=norm.offset_in_weight_dtype and emulate,
        round_before_weight=norm.round_before_weight and emulate,
        round_sum=(norm.residual is not None and norm.dtype != torch.float32
                   and not norm.sum_in_f32 and (emulate or _stored(norm))),
        out_f32=norm.out_dtype == torch.float32, two_shot_min_bytes=two_shot)
    # functional in the graph: auto_functionalized returns (normed, new residual), and
    # Inductor's reinplacing decides whether the op may write over x (x dead here).
    # It does not see that the op also reads x as its residual or weight (x + x, a
    # view of x): then the op gets a copy of x to write over.
    written = ar.input
    if _aliases(written, norm.residual, norm.weight):
        with graph.inserting_after(anchor):
            written = anchor = insert_call(graph, torch.ops.aten.clone.default, (written,),
                                           like=norm.output)
    with graph.inserting_after(anchor):
        fused = insert_call(
            graph, auto_functionalized, (torch.ops.commfold.allreduce_rmsnorm.default,),
            dict(x=written, residual=norm.residual, weight=norm.weight, eps=norm.eps,
                 weight_offset=norm.offset, flags=flags, comm=ar.comm), like=norm.output)
    with graph.inserting_after(fused):
        new_residual = insert_call(graph, operator.getitem, (fused, 1), like=norm.output)
    with graph.inserting_after(fused):
        out = insert_call(graph, operator.getitem, (fused, 0), like=norm.output)
    norm.output.replace_all_uses_with(out)
    private = set(norm.inner) | {norm.output}
    if norm.h is not None:
        norm.h.replace_all_uses_with(new_residual, delete_user_cb=lambda u: u not in private)
    chain = set([norm.output, *norm.inner, *([norm.h] if norm.h is not None else []),
                 *ar.comm_nodes])
    operands = dict.fromkeys(a for n in chain for a in n.all_input_nodes if a not in chain)
    for node in sorted(chain, reverse=True):  # users before their inputs
        if not node.users:  # readers first: each node is erased once
            graph.erase_node(node)
    for node in operands:  # e.g. 1 + w.float(): unread now
        if not node._erased:
            erase_if_dead(node)
    if not ar.collective._erased:  # would run the collective twice: never leave it
        raise RuntimeError("fuse_allreduce_rmsnorm: the original all-reduce is still read")
    x = tensor_val(ar.input)
    size = nbytes(x)
    ctx.rewrote(PATTERN, norm.output, Comm(size, 1), Comm(size, 1), detail=_detail(x, norm))


def _aliases(x: torch.fx.Node, *others) -> bool:
    """Whether another operand shares x's storage (the node itself or a view of it)."""
    mine = get_node_storage(x)
    return any(o is x or (mine is not None and get_node_storage(o) == mine)
               for o in others if o is not None)


def _stored(norm: RMSNorm) -> bool:
    """The sum h is read outside the norm, so Inductor stores it (rounded to its
    dtype) and its norm kernel reads the stored value back."""
    return norm.h is not None and any(u not in norm.inner and u is not norm.output
                                      for u in norm.h.users)


def _detail(x, norm: RMSNorm) -> str:
    parts = [str(x.dtype).replace("torch.", ""),
             "+residual" if norm.residual is not None else "no residual",
             "no weight" if norm.weight is None else
             ("weight (1+w)" if norm.offset == 1.0 else
              f"weight (w{norm.offset:+g})" if norm.offset else "weight"),
             f"eps {norm.eps:g}"]
    if norm.round_before_weight:
        parts.append("cast before weight")
    if norm.eager:
        parts.append("vllm_ir")
    elif norm.sum_in_f32:
        parts.append("f32 sum")
    return ", ".join(parts)
