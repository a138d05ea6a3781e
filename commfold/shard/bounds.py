"""Top-k / top-p of Model Runner V2's sampled steps from vocab shards, by bounds.

V2 masks each row with vLLM's top-k / top-p kernel (``apply_top_k_top_p``: the Triton
pivot search wherever Triton runs) before its Gumbel draw. That kernel keeps the
exact top k (ties at the k-th value first in index order) or the smallest prefix of
mass p only when its search converges; when it stops after 18 steps it cuts at a
pivot within the search's last interval. Its path hangs on statistics of the whole
row in its own float order (a sample block's mean and deviation, float32 sums), so a
shard cannot repeat it. What a shard can do is bound where the cut lies, whichever
way the search went (read from the kernel, pinned by source in
commfold.vllm.sample.sampled_pick):

- top-k: the search keeps ``v_{k+1} <= lo <= v_k <= hi`` (the k-th and k+1-th
  largest values) and stops within (2/3)^18 of its first interval, which is at most
  ``4 (max - min) + |max| + |min|`` wide; its tie tolerance is 1e-9;
- top-p: probabilities are float32 sums over the row (the mass of a prefix is off by
  at most ``DELTA`` of the kernel's tiles), and the bisection stops within 2^-18 of
  the largest probability.

From one all-gather of each rank's largest values and six row statistics, every rank
computes the same two thresholds per row: ``keep`` (every token above it is kept,
however the search ended) and ``drop`` (no token below it is). commfold.vllm.sample.
sampled_pick then draws over the tokens above ``keep`` and, apart, over those between
(``Cut.below``, ``Cut.between``):
the token is V2's when the best noised token above ``keep`` beats every one between
(the draw is then the same over any set the kernel may have kept); otherwise that
row is made whole and cut by vLLM's own kernel (commfold.vllm.sample.shard_edge_rows), or,
past its limit, the step is gathered and V2 samples it. ``Cut.doubt`` names, from
the gathered values alone, every row where some rank may hold a token between the
bounds (V2's verification makes those rows whole). Rows whose cut cannot be bounded
from the gathered values (the mass p reaches past the candidates, +-inf logits, a
top-p row whose float32 sums could overflow or underflow in the kernel) give the
step to V2 as well, with the reason.

Only the gathered values are read (a communicator's all-gather, commfold.shard.comm):
no engine object, so the bounds are checked against a full row's exact cut in one
process (tests/test_shard_bounds.py).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from commfold.shard.comm import Comm

K_LIMIT = 1024  # the largest top_k taken on shards (its k + 1 values per rank gathered)
P_CANDIDATES = 1024  # the values per rank gathered for top-p's prefix mass
SHARD_FRACTION = 4  # ... and never more than a quarter of a rank's shard
TERNARY = (2.0 / 3.0) ** 18  # the top-k search's last interval, of its first
BISECT = 0.5 ** 18  # the top-p search's last interval, of the largest probability
TOLERANCE = 1e-9  # the kernel's equality tolerance (values and probabilities)
_U = 2.0 ** -24  # float32's unit roundoff
_STATS = 7  # max, finite min, finite count, sum of exp(x - max), largest unsent,
# the mean and deviation of the row's first tile (rank 0)
SIGMA_LOW = -3.813 * 1.15  # the kernel's lowest outlier sigma (its table's, less 15%)


def block_size(device_type: str) -> int:
    """The kernel's tile width on this device (vLLM's _topk_topp, pinned)."""
    return {"cpu": 256, "xpu": 4096}.get(device_type, 8192)


def candidates(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int, shard: int) -> int:
    """How many of its largest values each rank sends: k + 1 for the step's largest
    active top_k, P_CANDIDATES where a row has top_p; at most a quarter of the shard."""
    active = top_k[top_k < vocab]
    k = int(active.max()) + 1 if active.numel() else 0
    p = P_CANDIDATES if bool((top_p < 1.0).any()) else 0
    return min(max(k, p), shard // SHARD_FRACTION)


def exchanged_bytes(rows: int, top_k: torch.Tensor, top_p: torch.Tensor, vocab: int,
                    shard: int) -> int:
    """What one rank sends in cut()'s all-gather for `rows` rows with these top_k /
    top_p (one per row)."""
    m = candidates(top_k, top_p, vocab, shard)
    return rows * ((m + m % 2) // 2 + _STATS) * 8


def refusal(top_k: torch.Tensor, vocab: int, shard: int) -> str | None:
    """Why the step's top_k is not taken on shards (its exchange would not pay)."""
    active = top_k[top_k < vocab]
    k = int(active.max()) if active.numel() else 0
    limit = min(K_LIMIT, shard // SHARD_FRACTION - 1)
    return f"top_k={k} (local up to {limit})" if k > limit else None


class Cut(NamedTuple):
    keep: torch.Tensor  # [rows] float64: tokens above are in any set the kernel keeps
    drop: torch.Tensor  # [rows] float64: tokens below are in none
    rows: torch.Tensor  # [rows] bool: rows the kernel truncates at all
    # [rows] bool: rows where a rank may hold a token between drop and keep (one it
    # sent, or its largest unsent value not below drop): alike on every rank
    doubt: torch.Tensor

    def below(self, work: torch.Tensor) -> torch.Tensor:
        """[rows, n] bool: the columns of `work` (this rank's, one row per bound) not
        surely kept - at or below their row's keep - in the rows the kernel cuts."""
        return self.rows[:, None] & (work.double() <= self.keep[:, None])

    def between(self, work: torch.Tensor) -> torch.Tensor:
        """`work` where the kernel may or may not keep a token (from drop up to keep
        in a cut row), -inf elsewhere."""
        maybe = self.below(work) & (work.double() >= self.drop[:, None])
        return torch.where(maybe, work, float("-inf"))


def cut(comm: Comm, work: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab: int,
        shard: int) -> Cut | str:
    """The bounds of V2's top-k / top-p cut for each row of the step, from this rank's
    processed columns `work` [rows, n_local] (float32, temperature and min_p applied)
    and the rows' top_k (vocab: off) and top_p (1: off); a reason where they cannot be
    had. Every rank calls it together (one all-gather) and gets the same answer."""
    why = refusal(top_k, vocab, shard)
    if why is not None:
        return why
    m = candidates(top_k, top_p, vocab, shard)
    gathered = comm.all_gather(_payload(comm, work, m)).view(comm.world_size(),
                                                             work.shape[0], -1)
    return _bounds(gathered, m, top_k.to(torch.int64), top_p.to(torch.float64), vocab,
                   block_size(work.device.type))


def _payload(comm: Comm, work: torch.Tensor, m: int) -> torch.Tensor:
    """[rows, m/2 + _STATS] float64: this rank's m largest values (float32, two per
    float64, -inf past its columns) and its row statistics."""
    rows, n = work.shape
    width = m + m % 2
    values = work.new_full((rows, width), float("-inf"))
    if n:
        values[:, :min(m, n)] = work.topk(min(m, n), dim=-1).values
    finite = work.isfinite()
    count = finite.sum(-1)
    top = work.amax(-1).double() if n else work.new_full((rows,), float("-inf")).double()
    low = torch.where(finite, work, float("inf")).amin(-1).double() if n else \
        torch.full((rows,), float("inf"), dtype=torch.float64, device=work.device)
    shift = torch.where(top.isfinite(), top, 0.0)
    mass = torch.where(finite, (work.double() - shift[:, None]).exp(), 0.0).sum(-1)
    unsent = torch.where(count > m, values[:, m - 1].double() if m else top,
                         float("-inf"))
    stats = torch.stack([top, low, count.double(), mass, unsent,
                         *_first_tile(comm, work)], dim=-1)
    return torch.cat([values.view(torch.float64), stats], dim=-1).contiguous()


def _first_tile(comm: Comm, work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0: the mean and deviation of the finite values of the row's first tile, from
    which the kernel starts its searches (0, 0 where it has none, as the kernel); NaN
    where the tile is not all on rank 0, and on other ranks."""
    rows, n = work.shape  # rank 0's real columns: the row's first n
    tile = block_size(work.device.type)
    if comm.rank() != 0 or n < tile:
        nan = torch.full((rows,), float("nan"), dtype=torch.float64, device=work.device)
        return nan, nan
    block = work[:, :tile].double()
    finite = block.isfinite()
    count = finite.sum(-1).clamp(min=1)
    vals = torch.where(finite, block, 0.0)
    avg = vals.sum(-1) / count
    std = ((vals * vals).sum(-1) / count - avg * avg).clamp(min=0.0).sqrt()
    return avg, std


def _bounds(g: torch.Tensor, m: int, top_k: torch.Tensor, top_p: torch.Tensor,
            vocab: int, tile: int) -> Cut | str:
    world, rows, _ = g.shape
    half = (m + m % 2) // 2
    values = g[..., :half].contiguous().view(torch.float32).double()  # [w, rows, m']
    merged = values.permute(1, 0, 2).reshape(rows, -1).sort(-1, descending=True).values
    st = g[..., half:]
    gmax, gmin = st[..., 0].amax(0), st[..., 1].amin(0)
    if bool(gmax.isnan().any()):
        return "NaN logits: V2's own pick"
    tops = st[..., 0]
    z = (st[..., 3] * torch.where(tops.isfinite(), (tops - gmax).exp(), 0.0)).sum(0)
    rows_of = _Rows(merged, gmax, gmin, st[..., 2].sum(0), st[..., 4].amax(0), z,
                    st[0, :, 5], st[0, :, 6],
                    2.0 * (math.log2(tile) + math.ceil(vocab / tile) + 16) * _U)
    keep = torch.full((rows,), float("-inf"), dtype=torch.float64, device=g.device)
    drop = keep.clone()
    cut_rows = torch.zeros(rows, dtype=torch.bool, device=g.device)
    for r in range(rows):  # a step's rows: a few hundred at most, scalars each
        bounds = rows_of.bounds(r, int(top_k[r]), float(top_p[r]), vocab)
        if isinstance(bounds, str):
            return bounds
        if bounds is not None:
            keep[r], drop[r], cut_rows[r] = bounds[0], bounds[1], True
    sent = (values >= drop[:, None]) & (values <= keep[:, None])  # [w, rows, m']
    doubt = cut_rows & (sent.any(-1).any(0) | (st[..., 4] >= drop).any(0))
    return Cut(keep, drop, cut_rows, doubt)


class _Rows(NamedTuple):
    """The gathered values and statistics of the step's rows (float64)."""
    merged: torch.Tensor  # [rows, world * m]: every rank's largest values, descending
    top: torch.Tensor  # the row maximum
    low: torch.Tensor  # the finite minimum
    finite: torch.Tensor  # how many finite values
    unsent: torch.Tensor  # the largest value no rank sent
    z: torch.Tensor  # sum of exp(x - top)
    avg: torch.Tensor  # the first tile's mean (NaN: not on rank 0)
    std: torch.Tensor  # ... and deviation
    delta: float  # the kernel's float32 error on a prefix's mass

    def bounds(self, r: int, k: int, p: float, vocab: int) -> tuple[float, float] | str | None:
        """(keep, drop) of row r, None where the kernel keeps every token."""
        n = int(self.finite[r])
        topk, topp = k < vocab and n > k, p < 1.0 and n > 0
        if not (topk or topp):
            return None
        hi, lo = float(self.top[r]), float(self.low[r])
        if not (math.isfinite(hi) and math.isfinite(lo)):
            return "+-inf logits in a top-k / top-p row"
        # the kernel's float32 rounding of a pivot and of its log / exp round trip
        slack = 2.0 ** -16 * (abs(hi) + abs(lo)) + 4 * TOLERANCE
        row = self.merged[r]
        keep_k = drop_k = -math.inf
        if topk:
            exact = self._top_k_exact(r, k, row, slack)
            if exact is not None and not topp:
                return exact
            if exact is not None:  # top-p then runs over exactly the top k
                keep_k = drop_k = exact[0]
            else:
                width = 1.05 * TERNARY * self._top_k_span(r, hi, lo) + slack
                keep_k, drop_k = float(row[k - 1]) + width, float(row[k]) - width
        if not topp:
            return keep_k, drop_k
        keep_p, drop_p = self._top_p(r, p, row, topk, keep_k, drop_k, hi, slack)
        if isinstance(keep_p, str):
            return keep_p
        return max(keep_k, keep_p), max(drop_k, drop_p)

    def _top_k_span(self, r: int, hi: float, lo: float) -> float:
        """The widest first interval of the kernel's top-k search: from the row's
        maximum to its finite minimum or its outlier pivot (the first tile's mean plus
        at least SIGMA_LOW deviations), whichever is lower."""
        avg, std = float(self.avg[r]), float(self.std[r])
        if not (math.isfinite(avg) and math.isfinite(std)):
            return 4 * (hi - lo) + abs(hi) + abs(lo) + 1  # the pivot unknown: loosely
        return (hi - min(lo, avg + SIGMA_LOW * std)) * 1.01 + 1e-3

    def _top_k_exact(self, r, k: int, row, slack: float) -> tuple[float, float] | None:
        """The cut when the kernel's search surely ends on a pivot between the k-th and
        k+1-th values before its last step (the gap between them is more than a third
        of its interval at step 17) and the k-th value is no other token's: every
        token from the k-th up is kept, every other dropped."""
        vk, vk1 = float(row[k - 1]), float(row[k])
        unique = k == 1 or float(row[k - 2]) - vk > 4 * TOLERANCE
        gap = vk - vk1
        need = 1.05 * (2.0 / 3.0) ** 16 / 3 * self._top_k_span(
            r, float(self.top[r]), float(self.low[r])) + 4 * TOLERANCE + slack
        if not (unique and gap > need):
            return None
        middle = (vk + vk1) / 2
        return middle, math.inf  # nothing between: keep above the middle, drop below

    def _top_p(self, r: int, p: float, row, topk: bool, keep_k: float, drop_k: float,
               hi: float, slack: float):
        """(keep, drop) of top-p (over what top-k kept), or a reason in keep's place."""
        unsent = float(self.unsent[r])
        if topk:  # top-p over what top-k kept: its normalizer within two bounds
            if unsent >= drop_k:
                return "top-k: tokens near the k-th value were not gathered", None
            inside, sure = row >= drop_k, row > keep_k
        else:
            avg, std = float(self.avg[r]), float(self.std[r])
            if not (math.isfinite(avg) and math.isfinite(std)):
                return "top-p: the kernel's first tile spans ranks", None
            # its exponentials are taken from avg + 10 std: keep them normal floats
            if not -75.0 <= hi - (avg + 10.0 * std) <= 80.0:
                return "top-p: the kernel's float32 exponentials could overflow or " \
                       "underflow", None
            inside = sure = row > float("-inf")
        e = torch.where(inside, (row - hi).exp(), 0.0)
        e_sure = torch.where(sure, e, 0.0)
        z_hi = float(e.sum()) if topk else float(self.z[r])
        z_lo = float(e_sure.sum()) if topk else float(self.z[r])
        if z_lo <= 0.0:
            return "top-p: no token certainly kept by top-k", None
        most = e.cumsum(0) / z_lo  # a prefix's largest possible mass
        least = e_sure.cumsum(0) / z_hi  # ... and its smallest
        first = torch.nonzero(most >= p - self.delta)
        last = torch.nonzero(least >= p + self.delta)
        past = "top-p: the requested mass reaches past the gathered candidates"
        if not len(first) or not len(last):
            return past, None
        j_lo, j_hi = int(first[0]), int(last[0])
        if unsent >= float(row[j_hi]):
            return past, None
        q_max, q_cut = float(e[0]) / z_lo, float(e[j_hi]) / z_hi
        if not topk and j_hi == 0:  # the top token alone holds p: see _top_one
            one = self._top_one(row, q_max, z_lo, slack)
            if one is not None:
                return one
        t = (1.1 * BISECT * q_max + 4 * TOLERANCE) / q_cut if q_cut > 0 else math.inf
        margin = 1.1 * -math.log1p(-t) + slack if t < 1 else math.inf
        return float(row[j_lo]) + margin, float(row[j_hi]) - margin

    @staticmethod
    def _top_one(row, q_max: float, z: float, slack: float) -> tuple[float, float] | None:
        """Top-p where the top token alone holds p: the search's upper end stays that
        token's probability q1, so its pivot, found before the last step when q1 - q2
        exceeds 2^-16 q1, is at most (q1 + q2) / 2 - at least -log((1 + e^-d) / 2) below
        the top logit in the kernel's logit-space cut (d = x1 - x2), which keeps the
        top token alone where that exceeds the cut's rounding."""
        d = float(row[0] - row[1])
        q2 = q_max * math.exp(-d) if math.isfinite(d) else 0.0
        if q_max - q2 <= 1.1 * 2.0 ** -16 * q_max + 4 * TOLERANCE:
            return None
        if -math.log((1 + math.exp(-d)) / 2) <= 8 * slack:
            return None
        middle = (float(row[0]) + float(row[1])) / 2 if math.isfinite(d) else -math.inf
        return middle, math.inf
