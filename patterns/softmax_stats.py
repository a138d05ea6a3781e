"""Softmax-family row statistics over gathered logits, as torch 2.13 decomposes them
post-grad (the row X is the gathered row, after an optional slice to the valid vocab
and column-uniform elementwise ops such as a cast to float32 or a temperature):

    log_softmax(X)[.., idx]:  A = amax(X, [-1], True); D = X - A; S = sum(exp(D), [-1], True)
                              L = log(S); LP = D - L; gather(LP, -1, idx)
    logsumexp(X):             A = amax(..); W = where(abs(A) == inf, 0, A); D = X - W
                              S = sum(exp(D), [-1]); log(S) + squeeze(W)
    softmax(X).max(-1):       A, D, E = exp(D), S as above; max(E / S, -1) or argmax
    on CUDA (Inductor's online softmax, a post-grad pattern that runs before commfold):
                              P = prepare_softmax_online(X, -1); A = P[0]; S = P[1]
                              (S keeps its dim), D = X - A as above, E = exp(D) if read

plus greedy picks (argmax / max(dim=-1)) of the same gathered row. Every consumer of
every row-sized (vocab-wide) node must be one of these: a row-sized value that escapes
would need the gather. Row-wide reductions (A, S) and the values at chosen columns are
all the rewrite needs; row-sized nodes are left dead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import final

import torch
import torch.fx as fx

from commfold.fx.nodes import (arg, fake_tensor, is_call, is_getitem, norm_dim, only_user,
                            same_shape, tensor_val)

from .common import (Miss, Recognized, Verdict, aten, op_name, optional_op, prims, reader_within,
                     vocab_slice_end)
from .gather import VocabGather
from .greedy import is_elementwise, monotone_step

_GREEDY = (aten.argmax.default, aten.max.dim)


@final
@dataclass(frozen=True)
class SoftmaxStats:
    """One amax -> (x - shift) -> exp -> sum structure over row `base`."""

    base: fx.Node  # the row the statistics read
    chain: tuple[fx.Node, ...]  # elementwise ops from the gathered (sliced) row to base
    amax: fx.Node
    finite_shift: fx.Node | None  # logsumexp's where(|A| == inf, 0, A), or None
    shifted: fx.Node  # D
    exp: fx.Node | None  # None: the online form whose exp nothing reads
    sum: fx.Node
    log: fx.Node | None
    picks: tuple[fx.Node, ...]  # gather(LP, -1, idx) nodes
    softmax_max: tuple[fx.Node, ...]  # max.dim / argmax (E / S, -1) nodes
    online: fx.Node | None = None  # prepare_softmax_online, whose P[0] / P[1] are amax / sum

    @property
    def sum_keepdim(self) -> bool:
        return self.online is not None or bool(arg(self.sum, "keepdim"))


@final
@dataclass(frozen=True)
class Greedy:
    """argmax / max(dim=-1) of row `base`."""

    base: fx.Node
    chain: tuple[fx.Node, ...]
    pick: fx.Node


@final
@dataclass(frozen=True)
class RowReads:
    """Everything that reads gathered row `gather`: statistics and greedy picks."""

    gather: VocabGather
    valid_vocab: int | fx.Node | None
    stats: tuple[SoftmaxStats, ...]
    greedy: tuple[Greedy, ...]


def match_row_reads(g: VocabGather) -> Recognized[RowReads]:
    """The softmax statistics (and greedy picks) that are the only readers of g's
    row; None when no amax reads the row (nothing of this pattern here)."""
    start, valid = g.gathered, None
    rank = fake_tensor(g.shard).dim()
    first = only_user(start)
    if first is not None and is_call(first, aten.slice.Tensor):
        cut = vocab_slice_end(first, rank)
        if cut:
            start, valid = first, cut[0]
    stats: list[SoftmaxStats] = []
    greedy: list[Greedy] = []
    todo: list[tuple[fx.Node, tuple[fx.Node, ...]]] = [(start, ())]
    near = reader_within(g.gathered, lambda n: is_call(n, aten.amax.default)) is not None
    while todo:
        row, chain = todo.pop()
        claimed: set[fx.Node] = set()
        for user in list(row.users):  # structures first: they claim their D = X - A
            s = None
            if is_call(user, aten.amax.default) and _over_last(arg(user, "dim"), rank) \
                    and arg(user, "keepdim"):
                s = _match_stats(row, chain, user, rank)
            elif _is_online(user, row, rank):
                s = _match_online(row, chain, user, rank)
            if s is None:
                continue
            if not s:
                return s
            stats.append(s)
            claimed.update((user, s.shifted))
        for user in row.users:
            if user in claimed:
                continue
            if is_call(user, *_GREEDY) and _greedy_dim_ok(user, rank) and (
                    user.target is aten.argmax.default
                    or all(is_getitem(x) for x in user.users)):
                greedy.append(Greedy(row, chain, user))
            elif is_call(user, aten.clone.default) or (
                    user.op == "call_function" and is_elementwise(user)
                    and monotone_step(user, row) is None):  # clone: log_softmax's contiguous()
                todo.append((user, chain + (user,)))
            else:
                return _miss(near, user, "the gathered row has a consumer that needs "
                                         f"the full row ({op_name(user)})")
    if not stats:
        return None
    return RowReads(g, valid, tuple(stats), tuple(greedy))


def _is_online(node, row, rank) -> bool:
    op = optional_op("prims", "prepare_softmax_online")
    return op is not None and is_call(node, op) and node.args[0] is row \
        and _over_last(node.args[1], rank)


def _match_online(row, chain, online, rank) -> Verdict[SoftmaxStats]:
    """prepare_softmax_online(X, -1): its (max, sum) outputs stand for amax and the
    sum of exp(X - amax); the rest is the amax form's."""
    items = {u.args[1]: u for u in online.users if is_getitem(u)}
    if len(items) != len(online.users) or 0 not in items or 1 not in items:
        return Miss("prepare_softmax_online's outputs are read other than as max and sum",
                    online)
    return _match_stats(row, chain, items[0], rank, total=items[1], online=online)


def _match_stats(row, chain, amax, rank, total=None, online=None) -> Verdict[SoftmaxStats]:
    """From amax A (or the online form's max, with its sum `total`): D = X - A, the
    exp and sum of D, and what reads them."""
    shift_node, finite = amax, None
    amax_users = set(amax.users)
    where = next((u for u in amax_users if is_call(u, aten.where.self)), None)
    if where is not None:  # logsumexp: where(abs(A) == inf, 0, A)
        if not _is_finite_shift(where, amax):
            return Miss("amax is post-processed in an unknown way", where)
        shift_node, finite = where, where
    shifted = [u for u in row.users if _is_shift(u, row) and u.args[1] is shift_node]
    if len(shifted) != 1:
        return Miss("amax of the row is used other than as the softmax shift", amax)
    d = shifted[0]
    exp = only_user(d) if len(d.users) == 1 else next(
        (u for u in d.users if is_call(u, aten.exp.default)), None)
    if online is not None and not (exp is not None and is_call(exp, aten.exp.default)):
        exp = None  # the online form computed the sum itself
    elif exp is None or not is_call(exp, aten.exp.default):
        if any(is_call(u, aten.mul.Tensor) for u in d.users):  # (x - max(x)) * c, guarded
            return Miss("softmax of a scaled row in Inductor's guarded form "
                        "(where(all finite, (x - max x) * c, ...)): not supported yet", d)
        return Miss("shifted row is not exponentiated", d)
    if online is None:
        assert exp is not None  # the elif above returned otherwise
        sums = [u for u in exp.users if is_call(u, aten.sum.dim_IntList)]
        if len(sums) != 1 or not _over_last(arg(sums[0], "dim"), rank):
            return Miss("exp of the shifted row is not summed over the vocab dim", exp)
        total = sums[0]
    log = next((u for u in total.users if is_call(u, aten.log.default)), None)
    picks, maxes = [], []
    for u in d.users:  # log_softmax: LP = D - L, read only at chosen columns
        if u is exp:
            continue
        if not (is_call(u, aten.sub.Tensor) and u.args[0] is d and log is not None
                and u.args[1] is log and len(u.args) == 2 and not u.kwargs):
            return Miss(f"the shifted row feeds {op_name(u)}, which needs the full row", u)
        for r in u.users:
            why = _pick_problem(r, u, rank)
            if why:
                return Miss(why, r)
            picks.append(r)
    for u in (exp.users if exp is not None else ()):  # softmax: E / S, read by max(dim=-1)
        if u is total:
            continue
        if not (is_call(u, aten.div.Tensor) and u.args[0] is exp and u.args[1] is total):
            return Miss(f"exp of the shifted row feeds {op_name(u)}, which needs the full row", u)
        for r in u.users:
            if not (is_call(r, *_GREEDY) and _greedy_dim_ok(r, rank) and (
                    r.target is aten.argmax.default or all(is_getitem(x) for x in r.users))):
                return Miss(f"softmax row feeds {op_name(r)}, which needs the full row", r)
            maxes.append(r)
    return SoftmaxStats(row, chain, amax, finite, d, exp, total, log,
                        tuple(picks), tuple(maxes), online)


def _pick_problem(r: fx.Node, lp: fx.Node, rank: int) -> str | None:
    if not is_call(r, aten.gather.default) or r.args[0] is not lp:
        return f"log_softmax row feeds {op_name(r)}, which needs the full row"
    if norm_dim(arg(r, "dim"), rank) != rank - 1 or arg(r, "sparse_grad") or len(r.args) > 3:
        return "gather from the log_softmax row on a dim other than vocab"
    idx = r.args[2]
    iv = tensor_val(idx)
    if not isinstance(idx, fx.Node) or iv is None or iv.dim() != rank:
        return "gather index of another rank"
    if rank != 2 and not same_shape(list(iv.shape[:-1]), list(fake_tensor(lp).shape[:-1])):
        return "gather index leading dims differ from the logits' (beyond 2-D)"
    return None


def _is_finite_shift(where: fx.Node, amax: fx.Node) -> bool:
    cond, zero, a = where.args
    if a is not amax or not is_call(cond, aten.eq.Scalar) or cond.args[1] != math.inf:
        return False
    ab = cond.args[0]
    if not (is_call(ab, aten.abs.default) and ab.args[0] is amax):
        return False
    if is_call(zero, aten.full.default):
        return arg(zero, "fill_value") == 0 and list(arg(zero, "size")) == []
    return isinstance(zero, (int, float)) and zero == 0


def _is_shift(node, row) -> bool:
    return (is_call(node, aten.sub.Tensor) and node.args[0] is row and len(node.args) == 2
            and not node.kwargs and isinstance(node.args[1], fx.Node))


def _over_last(dims, rank) -> bool:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return len(dims) == 1 and norm_dim(dims[0], rank) == rank - 1


def _greedy_dim_ok(node, rank) -> bool:
    dim = arg(node, "dim")
    return dim is not None and norm_dim(dim, rank) == rank - 1


def _miss(near: bool, node, reason):
    return Miss(reason, node) if near else None


EXACT_WIDENING = {torch.bfloat16: torch.float32, torch.float16: torch.float32,
                  torch.float32: torch.float64}


def exact_widening(node: fx.Node) -> bool:
    """A copy or float cast that changes no value and no order (clone; bf16/fp16 ->
    f32 -> f64)."""
    if is_call(node, aten.clone.default):
        return True
    if not is_call(node, prims.convert_element_type.default):
        return False
    src = fake_tensor(node.args[0]).dtype
    dst = node.args[1]
    while src in EXACT_WIDENING and src != dst:
        src = EXACT_WIDENING[src]
    return src == dst
