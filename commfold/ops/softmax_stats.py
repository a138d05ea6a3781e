"""commfold::softmax_stats - the row statistics of softmax / log_softmax / logsumexp
over vocab-sharded logits, without gathering the logits.

Each rank reduces its valid columns to (m, s): its maximum m (NaN if it holds a NaN)
and s = sum(exp(x - c)) with the safe local shift c = m if m is finite else 0, summed
in float64. The ranks exchange those two numbers per row, plus optionally the first
maximum's global index and the logits at requested indices: one all-gather of
2 + argmax + picks float64 values per row per rank. Every rank then rebuilds

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
"""
from __future__ import annotations

import torch

from ..collectives import communicator


@torch.library.custom_op("commfold::softmax_stats", mutates_args=())
def softmax_stats(x: torch.Tensor, valid_vocab: int | None, comm: str, finite_shift: bool,
                  want_argmax: bool, picks: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M [*lead, 1], S [*lead, 1], argmax [*lead] int64 (empty unless want_argmax),
    log_softmax at picks [*plead, k] (empty unless picks)) of gathered[..., :valid_vocab],
    gathered = the ranks' shards x [*lead, Vs] concatenated in rank order. As
    aten.gather, picks may have fewer rows than x (2-D): the first rows are read."""
    c = communicator(comm)
    world, rank = c.world_size(), c.rank()
    vs = x.shape[-1]
    total = _slice_end(valid_vocab, world * vs)
    lead = x.shape[:-1]
    rows = x.reshape(-1, vs)[:, :max(0, min(vs, total - rank * vs))].double()
    n = rows.shape[0]

    if rows.shape[1] > 0:
        m, first = rows.max(dim=-1)  # NaN is the max; first max / first NaN
    else:  # only padding here: never the max, contributes nothing
        m = torch.full((n,), float("-inf"), dtype=torch.float64)
        first = torch.zeros(n, dtype=torch.int64)
    shift = torch.where(m.isfinite(), m, torch.zeros_like(m))
    s = (rows - shift[:, None]).exp().sum(-1)
    fields = [m, s]
    if want_argmax:
        fields.append((first + rank * vs).double())  # exact: vocab < 2**53
    if picks is not None:
        idx = _pick_rows(picks, x).long()
        _check_index(idx, total)
        local = idx - rank * vs
        mine = (local >= 0) & (local < rows.shape[1])
        safe = torch.where(mine, local, torch.zeros_like(local))
        part_rows = rows[:idx.shape[0]]
        got = part_rows.gather(-1, safe) if rows.shape[1] > 0 else \
            torch.zeros_like(safe, dtype=torch.float64)
        got = torch.where(mine, got, torch.zeros_like(got))
        fields.append(torch.cat([got, got.new_zeros(n - idx.shape[0], idx.shape[1])]))
    packed = torch.cat([f.reshape(n, -1) for f in fields], dim=-1)  # [rows, F]
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

    dtype = x.dtype
    out_m = big_m.to(dtype).reshape(*lead, 1)
    out_s = big_s.to(dtype).reshape(*lead, 1)
    col = 2
    if want_argmax:
        winner = ms.argmax(dim=0, keepdim=True)  # first max / first NaN over ranks
        out_i = every[..., col].gather(0, winner).to(torch.int64).reshape(lead)
        col += 1
    else:
        out_i = x.new_empty((0,), dtype=torch.int64)
    if picks is not None:  # (x[idx] - shift) - log(S), as the graph's gather(D - L, idx)
        idx = _pick_rows(picks, x).long()
        p = idx.shape[0]
        owner = (idx // vs).clamp(0, world - 1)  # [p, k]
        vals = every[:, :p, col:]  # [world, p, k]
        picked = vals.gather(0, owner.unsqueeze(0)).squeeze(0).to(dtype)
        shift = g_shift[:p, None].to(dtype)
        out_p = ((picked - shift) - out_s.reshape(n, 1)[:p].log()).reshape(picks.shape)
    else:
        out_p = x.new_empty((0,))
    return out_m, out_s, out_i, out_p


def _slice_end(end: int | None, width: int) -> int:
    if end is None:
        return width
    return max(0, min(width, end if end >= 0 else width + end))


def _pick_rows(picks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """picks as [p, k] with p <= rows of x (aten.gather's rule for 2-D inputs)."""
    if picks.dim() == 2 and x.dim() == 2:
        if picks.shape[0] > x.shape[0]:
            raise RuntimeError("commfold.softmax_stats: gather index has more rows than "
                               "the logits (the original program's gather raises here too)")
        return picks
    return picks.reshape(-1, picks.shape[-1])


def _check_index(idx: torch.Tensor, total: int) -> None:
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= total):
        raise RuntimeError(
            f"commfold.softmax_stats: gather index out of bounds for a vocab of {total} "
            "(the original program's gather raises here too)")


@softmax_stats.register_fake
def _(x, valid_vocab, comm, finite_shift, want_argmax, picks):
    lead = list(x.shape[:-1])
    stat = x.new_empty(lead + [1])
    index = x.new_empty(lead if want_argmax else [0], dtype=torch.int64)
    picked = x.new_empty(picks.shape) if picks is not None else x.new_empty([0])
    return stat, stat.clone(), index, picked
