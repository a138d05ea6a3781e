"""Vocab-parallel layers: the embedding (range mask on ids, offset, lookup in the local
shard, zeroing of out-of-shard rows, a sum all-reduce in any spelling patterns.allreduce
knows: c10d functional, vllm.all_reduce, vLLM CPU's shm) and the LM head (matmul with
a vocab shard of the weight, an all-gather on the last dim in any spelling
patterns.gather knows, optional slice to the valid vocab).

The embedding's id arithmetic is spelled differently per source and even per rank
(funcol: ``lt/ge -> bitwise_or -> sub -> where``; vLLM: two ``ge/lt`` ranges for the
base and the added vocab, ``bitwise_and/or/not``, ``mul`` of masks by offsets; rank 0's
zero offsets are constant-folded away). So the recognizer does not match one tree:
it checks the index and the zero-mask are built only from the ids and integer
constants by elementwise integer/bool ops, then EVALUATES them on every id in a range
that contains every breakpoint (a window of width 2*(S+2) around 0, S = the sum of the
magnitudes of the integer constants in that arithmetic: comparisons against such
constants, offset by such constants, cannot flip outside it), plus far-away probes.
The result is the rank's served id ranges: ``[lo, hi) -> shard rows from row_start``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import final

import torch
import torch.fx as fx

from commfold.fx.nodes import arg, fake_tensor, is_call, is_number, ndim, only_user, operands, val

from .allreduce import allreduce_candidates, match_allreduce
from .common import AUTO_FUNCTIONALIZED, Miss, Recognized, aten, prims, vocab_slice_end
from .gather import VocabGather

MAX_WINDOW = 1 << 23  # ids analysed densely per side (evaluated in 1M-id chunks)
MAX_SEGMENTS = 8


@final
@dataclass(frozen=True)
class IdRange:
    """ids in [lo, hi) read shard row ``id - lo + row_start`` (rank-local constants)."""

    lo: int
    hi: int
    row_start: int


@final
@dataclass(frozen=True)
class VocabParallelEmbedding:
    ids: fx.Node
    shard: fx.Node  # the [Vs, H] weight shard
    ranges: tuple[IdRange, ...]  # this rank's served ids
    output: fx.Node  # the reduced embedding (what the rewrite replaces)
    comm: str  # communicator spec (commfold.distributed.collectives)
    comm_nodes: tuple[fx.Node, ...]  # the all-reduce and its waits
    lookup: fx.Node  # the embedding node


@final
@dataclass(frozen=True)
class VocabParallelLMHead:
    hidden: fx.Node  # [N, H] rows fed to the matmul
    shard: fx.Node  # the [Vs, H] weight shard (before its transpose)
    gather: VocabGather
    reshape: fx.Node | None  # the reshape of the [N, Vs] logits to [*lead, Vs], if any
    valid_vocab: int  # columns kept by a slice after the gather; 0 when none
    output: fx.Node  # the gathered (and sliced) logits: what the rewrite replaces


# ------------------------------------------------------------------ embedding

def embedding_candidates(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_call(n, aten.embedding.default)]


def match_embedding(lookup: fx.Node) -> Recognized[VocabParallelEmbedding]:
    """The vocab-parallel embedding around `lookup` (an aten.embedding), a Miss, or None
    when the lookup is not followed by a zeroing and an all-reduce (a plain embedding)."""
    shard, idx = operands(lookup)[:2]
    zero = only_user(lookup)
    if zero is None or not is_call(zero, aten.where.self):
        return None
    cond, a, b = operands(zero)
    if a is lookup and _is_zero(b):
        keep_when = True
    elif b is lookup and _is_zero(a):
        keep_when = False
    else:
        return None
    reduce = only_user(zero)
    if reduce is None or reduce not in allreduce_candidates(reduce.graph):
        return None
    ar = match_allreduce(reduce)
    if not ar:
        return ar
    if ar.reduce_op != "sum":
        return Miss(f"all-reduce with op {ar.reduce_op!r}, not a sum", reduce)
    output, comm, comm_nodes = ar.reduced, ar.comm, ar.comm_nodes
    if not isinstance(shard, fx.Node) or ndim(shard) != 2:
        return Miss("embedding weight is not a 2-D tensor", lookup)
    unsqueezed = is_call(cond, aten.unsqueeze.default) \
        and cond.args[1] in (-1, fake_tensor(cond).dim() - 1)
    mask = operands(cond)[0] if unsqueezed else None
    if mask is None:
        return Miss("rows are zeroed by something other than a per-id mask", zero)
    leaf_i, why_i = _leaf(idx)
    leaf_m, why_m = _leaf(mask)
    if why_i or why_m:
        return Miss(why_i or why_m, lookup)
    if leaf_i is None or leaf_i is not leaf_m:
        return Miss("index and mask are not computed from the same ids", lookup)
    ranges = _served_ranges(leaf_i, idx, mask, keep_when, int(fake_tensor(shard).shape[0]))
    if isinstance(ranges, str):
        return Miss(ranges, lookup)
    return VocabParallelEmbedding(leaf_i, shard, ranges, output, comm, comm_nodes, lookup)


_CMP = {aten.ge.Scalar, aten.gt.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.eq.Scalar,
        aten.ne.Scalar, aten.ge.Tensor, aten.gt.Tensor, aten.lt.Tensor, aten.le.Tensor,
        aten.eq.Tensor, aten.ne.Tensor}
_ARITH = {aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor,
          aten.bitwise_not.default, aten.logical_and.default, aten.logical_or.default,
          aten.logical_not.default, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor,
          aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.where.self,
          aten.masked_fill.Scalar, aten.clone.default, aten.alias.default}
_CAST = {prims.convert_element_type.default, aten._to_copy.default}
_INT_DTYPES = (torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_ALLOWED = _CMP | _ARITH | _CAST | {aten.full.default, aten.scalar_tensor.default}


def _is_zero(x) -> bool:
    if is_number(x):
        return x == 0
    if is_call(x, aten.full.default) and list(arg(x, "size")) == []:
        return arg(x, "fill_value") == 0
    if is_call(x, aten.scalar_tensor.default):
        return arg(x, "s") == 0
    return False


def _leaf(root: fx.Node):
    """(the one non-constant input the integer arithmetic of root reads, None) or
    (None, why not)."""
    leaves: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        v = val(n)
        if isinstance(v, torch.SymInt):
            return None, "shard bounds are run-time symbols (ints made dynamic), not constants"
        if not isinstance(v, torch.Tensor) or v.dtype not in _INT_DTYPES:
            return None, "ids arithmetic leaves integer/bool tensors"
        if n.op != "call_function" or n.target not in _ALLOWED:
            leaves.add(n)
            continue
        if n.target in _CAST and not _int_cast(n):
            return None, "ids are cast to a non-integer type"
        for a in n.all_input_nodes:
            stack.append(a)
    inputs = [n for n in leaves if not _is_const(n)]
    if len(inputs) != 1:
        return None, "index arithmetic reads more than the ids (not a range mask)"
    return inputs[0], None


def _is_const(n) -> bool:
    return is_call(n, aten.full.default, aten.scalar_tensor.default)


def _int_cast(n) -> bool:
    dtype = n.args[1] if n.target is prims.convert_element_type.default else n.kwargs.get("dtype")
    return dtype in _INT_DTYPES


def _constants(root: fx.Node, leaf: fx.Node) -> int:
    """Sum of magnitudes of the integer constants in root's arithmetic."""
    total, seen, stack = 0, set(), [root]
    while stack:
        n = stack.pop()
        if n in seen or n is leaf:
            continue
        seen.add(n)
        for a in list(n.args) + list(n.kwargs.values()):
            if is_number(a):
                total += abs(int(a))
        stack.extend(n.all_input_nodes)
    return total


def _evaluate(root: fx.Node, leaf: fx.Node, x: torch.Tensor, memo: dict) -> torch.Tensor:
    if root is leaf:
        return x
    if root in memo:
        return memo[root]
    args = fx.node.map_arg(root.args, lambda n: _evaluate(n, leaf, x, memo))
    kwargs = fx.node.map_arg(root.kwargs, lambda n: _evaluate(n, leaf, x, memo))
    if root.target in (aten.full.default, aten.scalar_tensor.default, aten._to_copy.default):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "layout")}
    if not callable(root.target):
        raise TypeError(f"{root} calls no function")
    out = root.target(*args, **kwargs)
    memo[root] = out
    return out


def _served_ranges(leaf, idx, mask, keep_when: bool, shard_rows: int):
    """This rank's served ids as IdRanges, or why they are not a range mask."""
    dtype = fake_tensor(leaf).dtype
    if dtype not in (torch.int32, torch.int64):
        return "ids are not int32/int64"
    span = _constants(idx, leaf) + _constants(mask, leaf) + 2
    if span > MAX_WINDOW:
        return "id arithmetic constants too large to analyse"
    info = torch.iinfo(dtype)
    far = [info.min // 4, -(1 << 30), -4 * span, 4 * span, 1 << 30, info.max // 4]
    x = torch.cat([torch.arange(-span, span + 1, dtype=dtype), torch.tensor(far, dtype=dtype)])
    rows_, conds = [], []
    for chunk in x.split(1 << 20):  # bounded memory: every intermediate is chunk-sized
        try:
            rows_.append(_evaluate(idx, leaf, chunk, {}).to(torch.int64))
            conds.append(_evaluate(mask, leaf, chunk, {}).to(torch.bool))
        except Exception as e:  # an op we cannot replay on concrete ids
            return f"id arithmetic could not be evaluated ({type(e).__name__})"
        if rows_[-1].shape != chunk.shape or conds[-1].shape != chunk.shape:
            return "id arithmetic is not elementwise"
    row, cond = torch.cat(rows_), torch.cat(conds)
    if (row < 0).any() or (row >= shard_rows).any():  # the original raises for such ids
        return "some ids index rows outside the shard"
    served = cond if keep_when else ~cond  # keep_when: where(cond, row, 0)
    n = 2 * span + 1
    if served[n:].any() or served[0] or served[n - 1]:
        return "ids far outside the vocabulary are looked up (no range mask)"
    ids, rows = x[:n][served[:n]].to(torch.int64), row[:n][served[:n]]
    # maximal runs of consecutive ids read at a constant offset: the served ranges
    breaks = ((ids[1:] - ids[:-1] != 1) | ((rows - ids)[1:] != (rows - ids)[:-1])).nonzero()
    starts = [0] + (breaks.flatten() + 1).tolist()
    ends = starts[1:] + [ids.numel()]
    if ids.numel() == 0:  # a shard of padding only (tiny vocab, many ranks): serves none
        return ()
    if len(starts) > MAX_SEGMENTS:
        return "served ids form too many ranges"
    ranges = [IdRange(int(ids[a]), int(ids[b - 1]) + 1, int(rows[a])) for a, b in zip(starts, ends)]
    if any(rg.lo < 0 for rg in ranges):
        return "negative ids are served"
    return tuple(ranges)


# ------------------------------------------------------------------ LM head

# vLLM CPU's matmuls on weights it packed for oneDNN at load (its LM head's too): the
# graph holds a handle, not the weight
_PACKED_MATMULS = ("_C::onednn_mm",)


def _packed_matmul(node: fx.Node) -> bool:
    """node reads the output of a functionalized matmul on a packed weight."""
    if not (is_call(node, operator.getitem) and node.args
            and is_call(node.args[0], *AUTO_FUNCTIONALIZED) and node.args[0].args):
        return False
    schema = getattr(node.args[0].args[0], "_schema", None)
    return getattr(schema, "name", None) in _PACKED_MATMULS


def _through_pad_mm(node) -> tuple[fx.Node, fx.Node] | None:
    """mm's unpadded operands when node is Inductor's padded matmul, else None. On GPUs
    Inductor's pad_mm (torch/_inductor/fx_passes/pad_mm.py) rewrites mm(a, b) with an
    unaligned dim, when a timed benchmark favours it, as mm(constant_pad_nd(a),
    constant_pad_nd(b)) sliced back to [M, N]: zeros padded on the right, so the
    product's kept part is mm(a, b). Taking both forms keeps the decision the same on
    ranks whose benchmarks chose differently."""
    cur = node
    while is_call(cur, aten.slice.Tensor) and arg(cur, "start") in (0, None) \
            and arg(cur, "step") in (1, None):
        cur = cur.args[0]
    if cur is node or not is_call(cur, aten.mm.default):
        return None
    a, b = (_unpadded(x) for x in cur.args)
    if a is cur.args[0] and b is cur.args[1]:
        return None
    va, vb = fake_tensor(a), fake_tensor(b)
    if list(fake_tensor(node).shape) != [va.shape[0], vb.shape[1]] or va.shape[1] != vb.shape[0]:
        return None  # not sliced back to the unpadded product
    return a, b


def _unpadded(x):
    """x's input when x is constant_pad_nd with zeros on the right only, else x."""
    if not is_call(x, aten.constant_pad_nd.default):
        return x
    pad, value = list(arg(x, "pad")), arg(x, "value")
    if value not in (0, 0.0, None) or any(p != 0 for p in pad[0::2]) \
            or any(p < 0 for p in pad[1::2]):
        return x
    return x.args[0]


def match_lm_head(g: VocabGather) -> Recognized[VocabParallelLMHead]:
    """The matmul whose vocab-sharded logits g gathers and the slice after it; a Miss
    for an LM head this pass cannot take; None when no matmul made the logits."""
    logits, reshape = g.shard, None
    if is_call(logits, aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        reshape, logits = logits, operands(logits)[0]
    if is_call(logits, aten.addmm.default):
        return Miss("vocab-parallel LM head with a bias", logits)
    if _packed_matmul(logits):
        return Miss("LM head matmul on a packed weight (vLLM CPU's _C.onednn_mm): the weight "
                    "is not in the graph to replicate", logits)
    padded = _through_pad_mm(logits)
    if padded is not None:
        hidden, wt = padded
    elif not is_call(logits, aten.mm.default):
        return None  # logits made some other way: not an LM head, nothing to note
    else:
        hidden, wt = operands(logits)
    if not (is_call(wt, aten.permute.default) and list(arg(wt, "dims")) == [1, 0]) \
            and not is_call(wt, aten.t.default):
        return Miss("LM head weight is not used transposed ([vocab, hidden] layout)", logits)
    shard = operands(wt)[0]
    if ndim(shard) != 2 or fake_tensor(shard).dtype != fake_tensor(hidden).dtype:
        return Miss("LM head weight is not a 2-D tensor of the hidden dtype", logits)
    if reshape is not None and fake_tensor(g.shard).shape[-1] != fake_tensor(logits).shape[-1]:
        return Miss("logits reshaped other than by their leading dims", logits)
    output, valid = g.gathered, 0
    width = g.world_size * fake_tensor(g.shard).shape[-1]
    user = only_user(g.gathered)
    if is_call(user, aten.slice.Tensor):
        cut = vocab_slice_end(user, fake_tensor(user).dim())
        end = cut[0] if cut else None
        if isinstance(end, int) and not isinstance(end, bool) and end < width:
            output, valid = user, end
    return VocabParallelLMHead(hidden, shard, g, reshape, valid, output)
