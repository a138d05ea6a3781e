"""fuse_allreduce_rmsnorm: a sum all-reduce, the optional residual add and the
RMSNorm after it become one commfold::allreduce_rmsnorm call.

Uses: patterns.allreduce.AllReduce (any spelling: c10d functional, in-place
dist.all_reduce, DTensor, vLLM), patterns.residual_scale.ResidualScale (a scaled
residual branch, residual + all_reduce(x) * c: Granite, MiniCPM; Gemma's embedding
times its 0-d ``normalizer`` tensor) and
patterns.rmsnorm.RMSNorm (hand-written f32 / bf16 / fp16, F.rms_norm / nn.RMSNorm,
Gemma's 1 + w, no weight, vLLM's f32-sum fused add + norm, vLLM's IR ops). A sum
all-reduce that reaches an RMSNorm within a few elementwise ops but matches nothing
is a near-miss naming the op in the way (patterns.norm_reach).

Why it is safe:
- the reduction is a sum (others are skipped), and the op runs the graph's own
  collective (same group, through commfold.distributed.collectives), so every rank still issues
  exactly one collective here, in the same order as before;
- the op returns the normed output and the new residual (x + residual, or the
  reduced value itself without a residual add); every other reader of those is
  rewired to them (a graph that never computes the new residual, e.g. vLLM's final
  norm, just leaves it unread). A reader of the reduced value before the add would need a value
  the op does not return: skipped;
- the norm's intermediates have no readers outside the norm (the recognizer checks);
- a residual add whose operands differ only by leading size-1 dims (a hook's [T, H]
  all-reduce added to a [1, T, H] residual stream: patterns.broadcast) repeats no
  element: the op gets both as views of the add's shape (unsqueeze / squeeze of dim
  0), so its outputs have the shapes of the add and the norm they replace; a view of
  the reduced value that only adds or removes leading 1s before the add is dropped
  with it (read by anything else: skipped);
- a scale is applied by the op where the graph applies it (after the reduction,
  before the add, in f32, rounded where the graph rounds it); the reduced value must
  have no other reader, and with a residual neither may the scaled one. FlashInfer's
  fusion (CUDA) has no scale: scaled sites on its devices stay unfused;
- the kernel rounds where the compiled graph would (see commfold.ops.allreduce_rmsnorm);
- the op writes the new residual over its input, but the graph holds it under
  auto_functionalized (functional): Inductor's reinplacing, not this pass, decides
  whether the input's buffer may be reused (it must be dead) or is copied first.
The decision depends on the graph and the config only: rank-consistent.

Cost rule (Config.fuse_cost_rule): a site where the fused op was measured slower than
the unfused all-reduce + Inductor's add + norm stays unfused, with a near-miss naming
the rule: commfold.cost's FUSE rule, by device kind, communicator (vLLM CPU's shared
memory, gloo, vLLM's own op, FlashInfer or the op's composite path on FlashInfer's
devices), dtype and the site's smallest possible size (a symbolic token count at its
range's lower bound); what the table does not list (vLLM's own op, say) is fused.
The measurements: docs/performance.md.

Writes: auto_functionalized(commfold::allreduce_rmsnorm[.scaled | .scaled_tensor], x,
residual, weight, eps, offset, flags, comm[, scale]) -> getitem 0 (normed), getitem 1
(new residual: the op writes it over x, in place when Inductor's reinplacing finds x
dead, into a copy otherwise).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor import config as inductor_config
from torch._inductor.fx_utils import get_node_storage

from commfold import cost
from commfold.context import PassContext
from commfold.distributed.collectives import communicator
from commfold.fx.nodes import fake_tensor, min_nbytes, nbytes
from commfold.fx.edit import erase_if_dead, insert_call
from commfold.ops import flashinfer_norm
from commfold.ops.allreduce_rmsnorm import SUPPORTED_DTYPES, pack_flags
from commfold.patterns.allreduce import AllReduce, allreduce_candidates, match_allreduce
from commfold.patterns.norm_reach import norm_path, unmatched_norm
from commfold.patterns.residual_scale import ResidualScale, match_residual_scale
from commfold.patterns.rmsnorm import match_rmsnorm
from commfold.patterns.rmsnorm_match import RMSNorm
from commfold.patterns.vendor_fused import match_vendor_fusion
from commfold.report import Comm

PATTERN = "all_reduce->rmsnorm"


def run(ctx: PassContext) -> None:
    for node in ctx.graph.nodes:  # sites vLLM fused itself: listed, never fused twice
        done = match_vendor_fusion(node)
        if done is not None:
            ctx.already(PATTERN, node, done.by)
    two_shot = ctx.config.two_shot_min_bytes
    for ar, scale, norm in ctx.matches(PATTERN, allreduce_candidates(ctx.graph),
                                       _allreduce_norm):
        unsafe = _unsafe(ar, scale, norm)
        if unsafe is not None:  # recorded at the node that failed: the user's line
            ctx.skipped(PATTERN, *unsafe)
            continue
        why = ctx.config.fuse_cost_rule and _slower(ar)
        if why:
            ctx.skipped(PATTERN, norm.output, why)
            continue
        _rewrite(ctx, ar, scale, norm, two_shot)


def _allreduce_norm(coll):
    """(AllReduce, ResidualScale or None, RMSNorm) for coll; a Miss when a norm almost
    matches, or when a sum all-reduce reaches one within a few elementwise ops and
    nothing matched (naming the op in the way); None otherwise (no near-miss: an
    all-reduce no RMSNorm reads, or an unusable one far from any)."""
    ar = match_allreduce(coll)
    if not ar:
        return ar if norm_path(coll) is not None else None
    norm = match_rmsnorm(ar.reduced)
    if norm:
        return ar, None, norm
    scale = match_residual_scale(ar.reduced)
    scaled = match_rmsnorm(scale.scaled) if scale is not None else None
    if scaled:
        return ar, scale, scaled
    found = norm if norm is not None else scaled
    if found is None and ar.reduce_op == "sum":
        return unmatched_norm(ar.reduced)
    return found


def _slower(ar: AllReduce) -> str | None:
    """Why the fused op would be slower here than the unfused program (the cost
    table's FUSE rule), or None."""
    x = fake_tensor(ar.input)
    device = x.device.type
    if device in flashinfer_norm.DEVICE_TYPES:  # the same install on every rank
        comm = cost.FLASHINFER if flashinfer_norm.flashinfer_comm() is not None \
            else cost.COMPOSITE
    else:
        comm = cost.comm_name(communicator(ar.comm), device)
    return cost.why_slower(cost.Site(cost.FUSE, device, comm, x.dtype, min_nbytes(x)))


def _unsafe(ar: AllReduce, scale: ResidualScale | None,
            norm: RMSNorm) -> tuple[fx.Node, str] | None:
    """(the node that fails, why) when the fusion would change the program, else None."""
    if ar.reduce_op != "sum":
        return ar.collective, \
            f"'{ar.reduce_op}' all-reduce (only a sum can be fused with the add)"
    dtype = fake_tensor(ar.input).dtype
    if dtype not in SUPPORTED_DTYPES or norm.dtype != dtype:
        return ar.collective, f"unsupported dtype {dtype} (norm input {norm.dtype})"
    if scale is not None and len(ar.reduced.users) > 1:
        return scale.scaled, \
            "the reduced value is read besides its scale (the op returns the scaled value)"
    if norm.residual is not None and (len(norm.x.users) > 1 or norm.x_view is not None
                                      and len(norm.x_view.users) > 1):
        return norm.h or norm.output, (
            f"the {'scaled' if scale else 'reduced'} value is read besides the residual "
            "add (the op returns only the sum with the residual)")
    if scale is not None and not scale.identity \
            and fake_tensor(ar.input).device.type in flashinfer_norm.DEVICE_TYPES:
        return scale.scaled, flashinfer_norm.NO_SCALE
    # FX nodes compare by graph position (O(1)): no per-match walk of the graph
    last_input = _last_operand(ar, scale, norm)
    readers = [u for n in (norm.h, norm.output) if n is not None for u in n.users
               if u not in norm.inner and u is not norm.output]
    early = [u for u in readers if not u > last_input]
    if early:
        return early[0], "the norm's operands are defined after readers of its result"
    return None


def _rewrite(ctx: PassContext, ar: AllReduce, scale: ResidualScale | None, norm: RMSNorm,
             two_shot: int) -> None:
    graph = ctx.graph
    # Inductor rounds a low-precision cast inside a kernel only when emulating casts,
    # and a stored buffer always; an eager op (vLLM IR) rounds at every cast: ask the
    # op to round where the unfused program would.
    emulate = bool(inductor_config.emulate_precision_casts) or norm.eager
    lowp = norm.dtype != torch.float32
    scaled = scale is not None and not scale.identity
    anchor = _last_operand(ar, scale, norm)
    flags = pack_flags(
        offset_in_weight_dtype=norm.offset_in_weight_dtype and emulate,
        round_before_weight=norm.round_before_weight and emulate,
        round_sum=((norm.residual is not None or scaled) and lowp
                   and not norm.sum_in_f32 and (emulate or _stored(norm))),
        out_f32=norm.out_dtype == torch.float32, two_shot_min_bytes=two_shot,
        scale_divides=scaled and scale is not None and scale.divides,
        # the scaled value is a stored buffer when an eager norm reads it itself
        round_scaled=scaled and lowp and (bool(inductor_config.emulate_precision_casts)
                                          or _eager_reads(norm, norm.x)))
    # functional in the graph: auto_functionalized returns (normed, new residual), and
    # Inductor's reinplacing decides whether the op may write over x (x dead here).
    # It does not see that the op also reads x as its residual or weight (x + x, a
    # view of x): then the op gets a copy of x to write over.
    written = ar.input
    if _aliases(written, norm.residual, norm.weight):
        with graph.inserting_after(anchor):
            written = anchor = insert_call(graph, torch.ops.aten.clone.default, (written,),
                                           like=norm.output)
    # a leading-1 broadcast add ([T, H] + [1, T, H]): the op reads both as views of
    # the add's shape, so its outputs have the shapes of the values they replace
    rank = fake_tensor(norm.output).dim()
    written, anchor = _to_rank(graph, written, rank, anchor)
    residual = norm.residual
    if residual is not None:
        residual, anchor = _to_rank(graph, residual, rank, anchor)
    op, args = torch.ops.commfold.allreduce_rmsnorm.default, {}
    if scaled and scale is not None:
        ops = torch.ops.commfold.allreduce_rmsnorm
        op, args = ops.scaled if scale.number else ops.scaled_tensor, dict(scale=scale.value)
    with graph.inserting_after(anchor):
        fused = insert_call(
            graph, auto_functionalized, (op,),
            dict(x=written, residual=residual, weight=norm.weight, eps=norm.eps,
                 weight_offset=norm.offset, flags=flags, comm=ar.comm, **args),
            like=norm.output)
    with graph.inserting_after(fused):
        new_residual = insert_call(graph, operator.getitem, (fused, 1), like=norm.output)
    with graph.inserting_after(fused):
        out = insert_call(graph, operator.getitem, (fused, 0), like=norm.output)
    norm.output.replace_all_uses_with(out)
    private = set(norm.inner) | {norm.output}
    if norm.h is not None:
        norm.h.replace_all_uses_with(new_residual, delete_user_cb=lambda u: u not in private)
    chain = set([norm.output, *norm.inner, *([norm.h] if norm.h is not None else []),
                 *([scale.scaled] if scale is not None else []), *ar.comm_nodes,
                 *([norm.x_view] if norm.x_view is not None else [])])
    operands = dict.fromkeys(a for n in chain for a in n.all_input_nodes if a not in chain)
    for node in sorted(chain, reverse=True):  # users before their inputs
        if not node.users:  # readers first: each node is erased once
            graph.erase_node(node)
    for node in operands:  # e.g. 1 + w.float(): unread now
        if not node._erased:
            erase_if_dead(node)
    if not ar.collective._erased:  # would run the collective twice: never leave it
        raise RuntimeError("fuse_allreduce_rmsnorm: the original all-reduce is still read")
    x = fake_tensor(ar.input)
    size = nbytes(x)
    ctx.rewrote(PATTERN, norm.output, Comm(size, 1), Comm(size, 1),
                detail=_detail(x, norm, scale if scaled else None))


def _last_operand(ar: AllReduce, scale: ResidualScale | None, norm: RMSNorm
                  ) -> torch.fx.Node:
    """The fused op's operand defined last: the op goes after it."""
    c = scale.value if scale is not None and isinstance(scale.value, torch.fx.Node) else None
    return max(n for n in (ar.collective, norm.residual, norm.weight, c) if n is not None)


def _to_rank(graph: torch.fx.Graph, x: torch.fx.Node, rank: int, anchor: torch.fx.Node
             ) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(x viewed with leading size-1 dims added or removed to the given rank, the new
    anchor): the recognizer checked that only such dims differ. Views go after anchor;
    x and anchor unchanged when x has that rank."""
    while fake_tensor(x).dim() != rank:
        grow = fake_tensor(x).dim() < rank
        op = torch.ops.aten.unsqueeze.default if grow else torch.ops.aten.squeeze.dim
        with graph.inserting_after(anchor):
            x = anchor = insert_call(graph, op, (x, 0), like=x)
    return x, anchor


def _aliases(x: torch.fx.Node, *others) -> bool:
    """Whether another operand shares x's storage (the node itself or a view of it)."""
    mine = get_node_storage(x)
    return any(o is x or (mine is not None and get_node_storage(o) == mine)
               for o in others if o is not None)


def _eager_reads(norm: RMSNorm, node: torch.fx.Node) -> bool:
    """An eager norm op reads node itself (then node is a stored, rounded buffer)."""
    return norm.eager and any(u is norm.output or u in norm.inner for u in node.users)


def _stored(norm: RMSNorm) -> bool:
    """The sum h is read outside the norm, so Inductor stores it (rounded to its
    dtype) and its norm kernel reads the stored value back."""
    return norm.h is not None and any(u not in norm.inner and u is not norm.output
                                      for u in norm.h.users)


def _detail(x, norm: RMSNorm, scale: ResidualScale | None) -> str:
    parts = [str(x.dtype).replace("torch.", ""),
             *([f"scaled ({'/' if scale.divides else '*'}{_scale_text(scale)})"] if scale else []),
             "+residual" if norm.residual is not None else "no residual",
             "no weight" if norm.weight is None else
             ("weight (1+w)" if norm.offset == 1.0 else
              f"weight (w{norm.offset:+g})" if norm.offset else "weight"),
             f"eps {norm.eps:g}"]
    dims = {fake_tensor(n).dim() for n in (norm.x, norm.residual, norm.output) if n is not None}
    if len(dims) > 1:
        parts.append("leading-1 broadcast")
    if norm.round_before_weight:
        parts.append("cast before weight")
    if norm.eager:
        parts.append("vllm_ir")
    elif norm.sum_in_f32:
        parts.append("f32 sum")
    return ", ".join(parts)


def _scale_text(scale: ResidualScale) -> str:
    return f"{scale.value:g}" if scale.number else "0-d tensor"
