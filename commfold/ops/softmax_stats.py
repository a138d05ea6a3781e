"""commfold::softmax_combine - the row statistics of softmax / log_softmax / logsumexp
over vocab-sharded logits, without gathering the logits.

Each rank reduces its valid columns (commfold::valid_columns masks the padding) to
(m, s): its maximum m (NaN if it holds a NaN) and s = sum(exp(x - c)) with the safe
local shift c = m if m is finite else 0, accumulated in float64 - graph ops, so
Inductor compiles those row-wide reductions into its own kernels. softmax_combine
exchanges those two numbers per row, plus optionally the first maximum's global index
and the logits at requested indices: one all-gather of 2 + argmax + picks float64
values per row per rank. Every rank then rebuilds

    M = max over ranks (NaN-propagating, as aten.amax)
    S = sum over ranks of s_r * exp(c_r - shift), shift = M, or the "finite shift"
        where(|M| == inf, 0, M) that torch's logsumexp decomposition uses

which is sum(exp(x - shift)) of the full row up to float64 rounding: the graph's own
sum node computed it in the logits' dtype in another order. When the shift is
infinite or NaN the graph's row is NaN throughout (inf - inf, NaN - x), and so is S.

The argmax rule is torch's: first maximum, a NaN is the maximum (first NaN wins);
shards are contiguous in rank order, so first-over-ranks then first-within-shard is
the full row's rule. Picked logits travel as float64 (exact for every float dtype)
and are taken from the rank that owns each index (so -0.0 and NaN payload bits
survive, as aten.gather's would).

commfold::softmax_stats is the whole thing in one op - the local statistics too - so
the rank's logits are read once: on CPU a C++ one-pass scan (commfold.ops.vocab_scan:
per block the maximum, then sum(exp(x - max)) in float64 from L1, the partial sum
rescaled when the maximum rises), the gather and the combine in C++; elsewhere the
torch implementation below. ``chain`` (commfold.ops.chain_encoding) is applied to each
logit first (a widening cast, a scale), without a materialized copy. valid_columns and
softmax_combine (the two-step form, statistics as graph ops) remain for callers.
"""
from __future__ import annotations

import torch

from commfold.distributed.collectives import communicator
from commfold.ops import chain_encoding, vocab_scan
from commfold.ops.vocab_slice import local_width, slice_end


@torch.library.custom_op("commfold::valid_columns", mutates_args=())
def valid_columns(x: torch.Tensor, valid_vocab: int | None, comm: str) -> torch.Tensor:
    """bool [Vs]: which of this rank's columns lie inside gathered[..., :valid_vocab]."""
    c = communicator(comm)
    vs = x.shape[-1]
    total = slice_end(valid_vocab, c.world_size() * vs)
    return torch.arange(vs, device=x.device) + c.rank() * vs < total


@valid_columns.register_fake
def _(x, valid_vocab, comm):
    return x.new_empty(x.shape[-1:], dtype=torch.bool)


@torch.library.custom_op("commfold::softmax_combine", mutates_args=())
def softmax_combine(x: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                    first: torch.Tensor | None, picks: torch.Tensor | None,
                    valid_vocab: int | None, comm: str, finite_shift: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's local statistics of shard x [*lead, Vs] - m (max of the valid
    columns, x's dtype), s (float64 sum of exp(x - m), m made finite) and first (the
    first max's local index) - exchanged in ONE all-gather and combined:
    (M [*lead, 1], S [*lead, 1], argmax [*lead] int64 (empty without first),
    log_softmax at picks [*plead, k] (empty without picks)). As aten.gather, picks may
    have fewer rows than x (2-D): the first rows are read."""
    c = communicator(comm)
    vs = x.shape[-1]
    total = slice_end(valid_vocab, c.world_size() * vs)
    rows = x.reshape(-1, vs)
    return _exchange(c, rows, vs, x.shape[:-1], x.dtype, m.reshape(-1), s.reshape(-1),
                     None if first is None else first.reshape(-1), picks, total,
                     finite_shift)


_SCHEMA = ("(Tensor x, Tensor? picks, SymInt? valid_vocab, str comm, bool finite_shift, "
           "bool argmax, float[]? chain=None) -> (Tensor, Tensor, Tensor, Tensor)")
_lib = torch.library.Library("commfold", "FRAGMENT")


def softmax_stats(x: torch.Tensor, picks: torch.Tensor | None, valid_vocab: int | None,
                  comm: str, finite_shift: bool, argmax: bool,
                  chain: list[float] | None = None):
    """softmax_combine's four outputs - (M, S, argmax, log_softmax at picks) of the
    rows of gathered[..., :valid_vocab] (chain applied first) - from shard x alone:
    this rank's statistics and their exchange in one op. S is sum(exp(x - shift)) with
    shift = M, or where(|M| == inf, 0, M) when finite_shift; argmax is empty unless
    asked for. Every rank of `comm` calls it together."""
    return torch.ops.commfold.softmax_stats.default(x, picks, valid_vocab, comm,
                                                    finite_shift, argmax, chain)


def softmax_stats_eager(x, picks, valid_vocab, comm, finite_shift, argmax, chain=None):
    """The torch implementation (any device, any communicator)."""
    c = communicator(comm)
    vocab_scan.note_communicator(c)
    vs = x.shape[-1]
    total, n_local = local_width(valid_vocab, c.world_size(), c.rank(), vs)
    out = chain_encoding.out_dtype(chain, x.dtype)
    rows = x.reshape(-1, vs)
    cols = rows[:, :n_local]
    seen = chain_encoding.apply(cols, chain) if chain else cols  # the compared values
    n = rows.shape[0]
    if n_local > 0:
        wide = seen if seen.dtype in (torch.float32, torch.float64) else seen.float()
        if argmax:
            top, first = wide.max(dim=-1)
        else:
            top, first = wide.amax(dim=-1), None
        shift = torch.where(top.isfinite(), top, torch.zeros_like(top))
        s = (wide - shift[:, None]).exp().sum(dim=-1, dtype=torch.float64)
    else:  # only padding here: contributes nothing
        top = torch.full((n,), float("-inf"), dtype=torch.float64, device=x.device)
        s = torch.zeros((n,), dtype=torch.float64, device=x.device)
        first = torch.zeros((n,), dtype=torch.int64, device=x.device) if argmax else None
    stored = chain_encoding.stored(seen, out) if chain else rows
    return _exchange(c, stored, vs, x.shape[:-1], out, top, s, first, picks, total,
                     finite_shift)


def _exchange(c, rows, vs: int, lead, dtype, m, s, first, picks, total: int,
              finite_shift: bool):
    """One all-gather of (m, s[, first][, rows at picks]) per row, combined (see the
    module docstring). rows: [n, >= this rank's valid columns], the values picks read;
    vs: columns per shard; m, s, first: [n]."""
    world, rank = c.world_size(), c.rank()
    n = m.shape[0]
    fields = [m.reshape(n, 1).double(), s.reshape(n, 1).double()]
    if first is not None:
        fields.append((first.reshape(n, 1) + rank * vs).double())  # exact: vocab < 2**53
    if picks is not None:
        idx = _pick_rows(picks, n).long()
        _check_index(idx, total)
        local = idx - rank * vs
        width = rows.shape[-1]
        mine = (local >= 0) & (local < width)
        got = rows[:idx.shape[0]].gather(-1, local.clamp(0, max(width - 1, 0))).double() \
            if width > 0 else torch.zeros(idx.shape, dtype=torch.float64, device=m.device)
        got = torch.where(mine, got, torch.zeros_like(got))
        fields.append(torch.cat([got, got.new_zeros(n - idx.shape[0], idx.shape[1])]))
    packed = torch.cat(fields, dim=-1)  # [rows, F]
    every = c.all_gather(packed).view(world, n, -1)

    ms, ss = every[..., 0], every[..., 1]  # [world, rows]
    big_m = ms.amax(dim=0)  # NaN-propagating, like aten.amax
    if finite_shift:
        g_shift = torch.where(big_m.abs() == float("inf"), torch.zeros_like(big_m), big_m)
    else:
        g_shift = big_m
    c_r = torch.where(ms.isfinite(), ms, torch.zeros_like(ms))
    part = torch.where(ss == 0, torch.zeros_like(ss), ss * (c_r - g_shift).exp())
    big_s = part.sum(dim=0)
    if not finite_shift:  # x - M with M = +-inf or NaN is NaN somewhere in the row
        big_s = torch.where(big_m.isfinite(), big_s, torch.full_like(big_s, float("nan")))

    out_m = big_m.to(dtype).reshape(*lead, 1)
    out_s = big_s.to(dtype).reshape(*lead, 1)
    col = 2
    if first is not None:
        winner = ms.argmax(dim=0, keepdim=True)  # first max / first NaN over ranks
        out_i = every[..., col].gather(0, winner).to(torch.int64).reshape(lead)
        col += 1
    else:
        out_i = m.new_empty((0,), dtype=torch.int64)
    if picks is not None:  # (x[idx] - shift) - log(S), as the graph's gather(D - L, idx)
        idx = _pick_rows(picks, n).long()
        p = idx.shape[0]
        owner = (idx // max(vs, 1)).clamp(0, world - 1)  # [p, k]
        vals = every[:, :p, col:]  # [world, p, k]
        picked = vals.gather(0, owner.unsqueeze(0)).squeeze(0).to(dtype)
        shift = g_shift[:p, None].to(dtype)
        out_p = ((picked - shift) - out_s.reshape(n, 1)[:p].log()).reshape(picks.shape)
    else:
        out_p = m.new_empty((0,), dtype=dtype)
    return out_m, out_s, out_i, out_p



def _stats_fake(x, picks, valid_vocab, comm, finite_shift, argmax, chain=None):
    dtype = chain_encoding.out_dtype(chain, x.dtype)
    lead = list(x.shape[:-1])
    stat = x.new_empty(lead + [1], dtype=dtype)
    index = x.new_empty(lead if argmax else [0], dtype=torch.int64)
    picked = x.new_empty(picks.shape if picks is not None else [0], dtype=dtype)
    return stat, stat.clone(), index, picked


vocab_scan.register_op(_lib, "softmax_stats", _SCHEMA, softmax_stats_eager, _stats_fake)


@softmax_combine.register_fake
def _(x, m, s, first, picks, valid_vocab, comm, finite_shift):
    lead = list(x.shape[:-1])
    stat = x.new_empty(lead + [1])
    index = x.new_empty(lead if first is not None else [0], dtype=torch.int64)
    picked = x.new_empty(picks.shape) if picks is not None else x.new_empty([0])
    return stat, stat.clone(), index, picked


def _pick_rows(picks: torch.Tensor, n: int) -> torch.Tensor:
    """picks as [p, k] with p <= n rows of the logits (aten.gather's rule for 2-D)."""
    if picks.dim() == 2:
        if picks.shape[0] > n:
            raise RuntimeError("commfold.softmax_stats: gather index has more rows than "
                               "the logits (the original program's gather raises here too)")
        return picks
    return picks.reshape(-1, picks.shape[-1])


def _check_index(idx: torch.Tensor, total: int) -> None:
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= total):
        raise RuntimeError(
            f"commfold.softmax_stats: gather index out of bounds for a vocab of {total} "
            "(the original program's gather raises here too)")
