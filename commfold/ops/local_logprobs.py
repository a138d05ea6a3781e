"""Logprobs as vLLM's sampler returns them - the top-k of log_softmax, the chosen
token's logprob and its rank - over vocab-sharded logits, without gathering them.

vLLM (``Sampler.gather_logprobs`` over ``log_softmax(logits, dtype=float32)``) takes
``torch.topk(logprobs, k)``, the logprob at the chosen token, and as its rank the
number of logprobs >= that one. Here each rank keeps its shard and the ranks
exchange, in two all-gathers of a few float64 per row:

1. per rank, in one pass over its shard (commfold's softmax-statistics scan): its max
   m, first argmax and log-sum-exp (sum in float64); x at the target token if it owns
   it, and how many top-k candidates it has (commfold.ops.logprob_scan). Every rank
   then knows M, S, L = log S (as float32), the token (the target, or the first
   maximum: torch.argmax's rule, NaN included) and its logprob lp_t = (x_t - M) - L,
   computed in float32 as torch's CPU log_softmax computes it.
2. per rank: how many of its columns have x - M >= x_t - M (the rank's part of
   vLLM's rank), how many are within a margin below that, and its candidates
   (float32 value and global index in one int64). Their logprobs, in rank order, go
   through torch.topk itself (``heap_topk``): the same top-k and the same order among
   equal logprobs as torch.topk over the full row (torch.topk's CPU order among ties
   is its heap's, neither index order nor stable).

Logprob values differ from vLLM's only by L: vLLM's float32 sum over the whole row
rounds differently from the ranks' float64 sums (a few float32 ulps of the logprob at
V=151936), and how it rounds depends on the CPU (torch's vector width). Which
logprobs are *equal* can depend on L too: two logits a few ulps of the logprob apart
may round to one float32 logprob under one L and to two under another (near-uniform
logits, such as dummy weights give). So ids and ranks are taken only where no L can
change them: no two distinct candidates, and no column just below the scored token,
within ``_MARGIN`` ulps of the logprob of each other; there, equal logprobs are
exactly equal logits, under vLLM's L as under ours. Other rows - and rows whose
maximum is not finite (NaN, +-inf: vLLM's log_softmax gives NaN rows there) - are
gathered whole and handed to ``fallback`` - vLLM's own code - so they come out
exactly as vLLM's. Every rank decides on the same gathered values, so all gather the
same rows.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from commfold.distributed.collectives import communicator
from commfold.ops.logprob_scan import candidates, count_logprob_ge, heap_topk, row_stats
from commfold.ops.vocab_slice import local_width

Fallback = Callable[[torch.Tensor, torch.Tensor, int],
                    tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def local_logprobs(shard: torch.Tensor, valid_vocab: int, comm: str, k: int,
                   fallback: Fallback, targets: torch.Tensor | None = None):
    """shard [R, Vs]: this rank's logits, the ranks' shards concatenated in rank
    order giving [R, world * Vs], of which the first valid_vocab columns are the
    vocab. targets [R] (int64): the tokens to score (prompt logprobs); None scores the
    greedy token. fallback(full_logits [n, valid_vocab], tokens [n], k) -> vLLM's
    (token ids [n, k + 1], logprobs [n, k + 1], ranks [n]) for rows done whole.

    Returns (tokens [R] int64, token ids [R, k + 1] int64 - the token, then the top
    k -, logprobs [R, k + 1] float32, ranks [R] int64)."""
    c = communicator(comm)
    world, rank = c.world_size(), c.rank()
    rows, vs = shard.shape
    _, n_local = local_width(valid_vocab, world, rank, vs)
    if rank == 0 and n_local < k:  # the row's first k entries are rank 0's
        raise ValueError(f"commfold.local_logprobs: rank 0 holds {n_local} < k = {k} columns")
    x, first = shard[:, :n_local], rank * vs
    one = _round_one(c, shard, n_local, first, k, targets)
    tokens, x_t, big_m, log_s = one.tokens, one.x_t, one.big_m, one.log_s
    big_m32 = big_m.float()
    lp_t = (x_t - big_m32) - log_s
    whole = ~big_m.isfinite()

    # round 2: this rank's part of the rank count (x - M >= x_t - M, on the logits: L
    # cannot change it) and of the count within the margin below; its candidates
    d_t = x_t - big_m32
    no_l = torch.zeros_like(log_s)
    ge = count_logprob_ge(shard, n_local, big_m32, no_l, d_t)
    near = count_logprob_ge(shard, n_local, big_m32, no_l, d_t - _margin(lp_t))
    counts, proxy_x, proxy_ids = _round_two(c, x, first, one.idx, [ge, near], one.width)
    ranks = counts[:, 0]
    whole = whole | (counts[:, 1] != ranks)  # a column L may tie with the token
    ids = tokens[:, None]
    lps = lp_t[:, None]
    if k:
        d = torch.where(proxy_x == -math.inf, -math.inf, proxy_x - big_m32[:, None])
        proxy = d - log_s[:, None]
        whole = whole | _near_distinct(d, proxy)
        top, where = heap_topk(proxy, k)
        ids = torch.cat([ids, proxy_ids.gather(1, where)], 1)
        lps = torch.cat([lps, top], 1)

    if bool(whole.any()):  # every rank computes the same mask: all gather these rows
        sel = whole.nonzero()[:, 0]
        full = c.all_gather(shard[sel].contiguous()).view(world, len(sel), vs)
        full = full.permute(1, 0, 2).reshape(len(sel), world * vs)[:, :valid_vocab]
        f_ids, f_lps, f_ranks = fallback(full, tokens[sel], k)
        ids, lps, ranks = ids.clone(), lps.clone(), ranks.clone()
        ids[sel], lps[sel], ranks[sel] = f_ids.long(), f_lps.float(), f_ranks.long()
    return tokens, ids, lps, ranks


_LOW = (1 << 32) - 1
# How close (in ulps of the logprob) two distinct logits may come before the float32
# rounding of (x - M) - L, for some L near ours, could make their logprobs equal.
# Rounding merges values less than 1 ulp apart; 8 covers vLLM's logprob landing in the
# next binade up (2x the ulp) with room to spare.
_MARGIN = 8


def _margin(lp: torch.Tensor) -> torch.Tensor:
    """_MARGIN ulps of |lp| (float32); 0 where lp is not finite."""
    a = lp.abs()
    ulp = torch.nextafter(a, torch.full_like(a, math.inf)) - a
    return torch.where(a.isfinite(), _MARGIN * ulp, torch.zeros_like(a))


def _near_distinct(d: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """Rows [rows, width] of candidates (d = x - M, -inf in unused slots; lp their
    logprobs): True where two distinct finite d are within the margin of each other,
    so whether their logprobs tie depends on L."""
    if d.shape[1] < 2:
        return torch.zeros(d.shape[0], dtype=torch.bool, device=d.device)
    d_sorted, order = d.sort(-1, descending=True)
    gap = d_sorted[:, :-1] - d_sorted[:, 1:]  # inf or NaN next to -inf: never near
    low = _margin(lp.gather(1, order)[:, 1:])
    return ((gap > 0) & (gap <= low)).any(-1)


def _pack(values, index):
    """int64: float32 value bits in the high half, a (non-negative) index in the low."""
    v = torch.as_tensor(values, dtype=torch.float32)
    bits = v.view(torch.int32).to(torch.int64) & _LOW
    return (bits << 32) | torch.as_tensor(index, dtype=torch.int64)


def local_topk_scores(shard: torch.Tensor, valid_vocab: int, comm: str, k: int,
                      logits_mode: bool, exact_ties: bool | None = None,
                      targets: torch.Tensor | None = None):
    """Model Runner V2's logprobs (``compute_topk_scores`` without custom token ids)
    over vocab-sharded logits: ids = [the token - targets [R] int64, or the first
    argmax -, torch.topk(logits, k) indices], scores = their logprobs (x - M) - L in
    float32 (logits_mode: the logits themselves, as float32), rank = how many logits
    are >= the token's. V2 ranks the
    *logits*, so ids and ranks do not depend on L, and are exact: the ranks' top-k
    candidates (logprob_scan.candidates) reproduce torch.topk's CPU heap, its order
    among equal logits included. exact_ties (default: on CPU) says whether the full
    row's torch.topk runs that heap; elsewhere (CUDA's radix select orders equal values
    its own way) rows whose top k + 1 logits hold two equal values are done whole.
    Logprob scores differ from V2's only by L (V2's float32 block sums vs float64
    here: a few float32 ulps).

    Returns TopkScores: rows marked whole (a maximum not finite, a -inf among the top
    k or as the token's logit - V2's rank kernel counts its masked lanes then -, a tie
    where ties are not exact) hold nothing usable; the caller computes them from
    gathered rows with vLLM's own code. Every rank computes the same mask."""
    c = communicator(comm)
    world, rank = c.world_size(), c.rank()
    rows, vs = shard.shape
    _, n_local = local_width(valid_vocab, world, rank, vs)
    if rank == 0 and n_local < k + 1:
        raise ValueError(f"commfold.local_topk_scores: rank 0 holds {n_local} <= k = {k} "
                         "columns")
    if exact_ties is None:
        exact_ties = shard.device.type == "cpu"
    x, first = shard[:, :n_local], rank * vs
    kk = k if exact_ties else k + 1  # one more: is the k-th tied with the next?
    one = _round_one(c, shard, n_local, first, kk, targets)
    tokens, x_t, big_m, log_s = one.tokens, one.x_t, one.big_m, one.log_s
    big_m32 = big_m.float()
    whole = ~big_m.isfinite()
    if targets is not None:  # vLLM reads what it reads outside the vocab
        outside = (tokens < 0) | (tokens >= valid_vocab)
        whole = whole | (x_t == -math.inf) | x_t.isnan() | outside

    # round 2: this rank's count of logits >= the token's, and its candidates
    zero = torch.zeros_like(log_s)
    ge = count_logprob_ge(shard, n_local, zero, zero, x_t)  # 0 where n_local is 0
    counts, proxy, proxy_ids = _round_two(c, x, first, one.idx, [ge], one.width)
    ranks = counts[:, 0]
    ids = tokens[:, None]
    xs = x_t[:, None]
    if kk:
        top, where = heap_topk(proxy, kk)
        whole = whole | (top[:, :k] == -math.inf).any(-1)  # a -inf is no candidate
        if not exact_ties:
            whole = whole | (top[:, 1:] == top[:, :-1]).any(-1)
        ids = torch.cat([ids, proxy_ids.gather(1, where[:, :k])], 1)
        xs = torch.cat([xs, top[:, :k]], 1)
    scores = xs if logits_mode else (xs - big_m32[:, None]) - log_s[:, None]
    return TopkScores(tokens, ids, scores, ranks, whole, big_m32)


class _RoundOne(NamedTuple):
    """Round 1's outcome: the same on every rank but idx."""
    tokens: torch.Tensor  # [R] int64: the targets, or the first maximum
    x_t: torch.Tensor  # [R] float32: the token's logit (the owner's bits)
    big_m: torch.Tensor  # [R] float64: M, the row's maximum
    log_s: torch.Tensor  # [R] float32: L = log sum exp(x - M)
    idx: torch.Tensor  # [R, <= width] int64: this rank's candidates' columns (-1: none)
    width: int  # the most candidates a rank holds in a row


def _round_one(c, shard, n_local: int, first: int, k: int,
               targets: torch.Tensor | None) -> _RoundOne:
    """One all-gather of (m, log-sum-exp, first argmax, candidate count, x at the
    target) per row per rank: from one pass over each shard (softmax-statistics
    scan), the row's M, L, token and the token's logit on every rank."""
    rows, vs = shard.shape
    world = c.world_size()
    x = shard[:, :n_local]
    dev = shard.device
    if n_local:  # one pass: max, first max / first NaN (torch.argmax), float64 sum
        m, lse, arg = row_stats(x)
        arg = arg + first
    else:  # only padding here: never the maximum
        m = torch.full((rows,), -math.inf, device=dev)
        arg = torch.zeros(rows, dtype=torch.long, device=dev)
        lse = torch.full((rows,), -math.inf, device=dev)
    if k and n_local:
        idx, count = candidates(shard, n_local, k)
    else:
        idx = torch.empty(rows, 0, dtype=torch.long, device=dev)
        count = torch.zeros(rows, dtype=torch.long, device=dev)
    xt = torch.zeros(rows, dtype=torch.float64, device=dev)
    if targets is not None and n_local:  # the target's logit, where this rank holds it
        local_t = targets - first
        mine = (local_t >= 0) & (local_t < n_local)
        xt = torch.where(mine, x.gather(1, local_t.clamp(0, n_local - 1)[:, None])[:, 0]
                         .double(), xt)
    one = torch.stack([m.double(), lse.double(), arg.double(), count.double(), xt], -1)
    every = c.all_gather(one).view(world, rows, 5)
    ms = every[..., 0]
    big_m = ms.amax(0)
    lses = every[..., 1]  # -inf: a rank holding nothing (or only -inf)
    part = torch.where(lses == -math.inf, torch.zeros_like(lses), torch.exp(lses - big_m))
    log_s = part.sum(0).log().float()
    if targets is None:  # first max / first NaN over ranks; its logit is the maximum
        tokens = every[..., 2].gather(0, ms.argmax(0, keepdim=True))[0].long()
        x_t = big_m.float()
    else:  # the owner's value (-0.0 and NaN bits as the logits hold them)
        tokens = targets.long()
        owner = (tokens // max(vs, 1)).clamp(0, world - 1)
        x_t = every[..., 4].gather(0, owner[None])[0].float()
    return _RoundOne(tokens, x_t, big_m, log_s, idx, int(every[..., 3].max()))


def _round_two(c, x: torch.Tensor, first: int, idx: torch.Tensor,
               counts: list[torch.Tensor], width: int):
    """One all-gather of this rank's counts and its candidates (float32 value bits
    << 32 | global index, one int64 each). Returns (the counts summed over ranks
    [R, len(counts)], every rank's candidates in rank order: values [R, world * width]
    float32, -inf in unused slots, and their global indices)."""
    rows, n, world = x.shape[0], len(counts), c.world_size()
    two = torch.full((rows, n + width), int(_pack(-math.inf, 0)), dtype=torch.long,
                     device=x.device)
    for j, count in enumerate(counts):
        two[:, j] = count
    if idx.shape[1]:  # this rank's candidates, in the first columns of the width
        vals = torch.where(idx >= 0, x.gather(1, idx.clamp(min=0)).float(), -math.inf)
        two[:, n:n + idx.shape[1]] = _pack(vals, idx.clamp(min=0) + first)
    got = c.all_gather(two).view(world, rows, n + width)
    packed = got[..., n:].permute(1, 0, 2).reshape(rows, world * width)
    values = ((packed >> 32) & _LOW).to(torch.int32).view(torch.float32)
    return got[..., :n].sum(0), values, packed & _LOW


class TopkScores(NamedTuple):
    tokens: torch.Tensor  # [R] int64: the targets, or the first maximum
    ids: torch.Tensor  # [R, k + 1] int64: the token, then the top k
    scores: torch.Tensor  # [R, k + 1] float32: their logprobs (or logits)
    ranks: torch.Tensor  # [R] int64: logits >= the token's
    whole: torch.Tensor  # [R] bool: rows to do from the gathered row
    maxima: torch.Tensor  # [R] float32: the row's maximum (NaN when the row holds one)
