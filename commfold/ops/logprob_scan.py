"""Row scans over a vocab shard for vLLM's logprobs (commfold.ops.local_logprobs):
each rank's row statistics, torch.topk's exact result from a few candidates per row,
and the rank count - on the C++ scans of vocab_scan_cpu.cpp (the local selection
ops' kernels), with torch ops where no compiler is available.

torch.topk's exact result - its order among equal values included - from a few
entries per row instead of the whole row:

On CPU, torch.topk(x, k) with k * 64 <= n runs std::partial_sort: a heap of the
first k entries, then each later entry enters (evicting the heap's smallest) only if
it is strictly larger than the heap's smallest. Entries that never enter never touch
the heap, so the heap - and the order its final sort gives to equal values, which is
neither index order nor stable - depends only on the entries that enter, in row
order. Those are the *candidates*: the first k, then every x[j] larger than the k-th
largest of x[:j] (about k + k ln(n / k) of them in a row in random order) - exactly
the entries commfold's top-k scan takes into its running list.

A vocab-sharded row: each rank's candidates over its own shard are a superset of the
row's candidates in that shard (a shard's prefix is part of the row's prefix), and
extra entries are rejected by the heap exactly as in the full row. So the ranks'
candidates, in rank order and padded past 64 k with -inf (which never enters),
reproduce torch.topk over the full row: ``heap_topk``. Candidates may be taken on
values that are a monotone (non-decreasing) function of the row's values, e.g. the
logits of a row whose log_softmax is ranked (x_j > t implies f(x_j) >= f(t): still a
superset).
"""
from __future__ import annotations

import math

import torch

from commfold.ops.vocab_scan import module

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _scan(x: torch.Tensor, n: int):
    """(the C++ module, x with a unit last stride) when the scans take x[:, :n]."""
    cpu = x.device.type == "cpu"  # the C++ scans are CPU kernels
    m = module() if cpu and x.dtype in _DTYPES and n > 0 and x.dim() == 2 else None
    return (m, x if x.stride(1) == 1 else x.contiguous()) if m is not None else (None, x)


def row_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, n > 0]: (max as float32 - NaN if any -, log-sum-exp as float64 - its
    sum of exp in float64 -, first argmax: torch.argmax's rule, NaN included)."""
    m, xs = _scan(x, x.shape[1])
    if m is not None:
        big, s, first = m.softmax_rows(xs, x.shape[1], None)
        return big, big.double() + s.log(), first
    big, first = x.max(-1)
    return big.float(), torch.logsumexp(x.double(), -1), first


def candidates(x: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, >= n]: (column indices [rows, most] int64 in column order, -1 past
    each row's count; counts [rows]) of candidates of x[:, :n] for a heap top-k."""
    m, xs = _scan(x, n)
    if m is not None and 0 < k <= 64:
        return m.candidates(xs, n, k)
    return _candidates_torch(x[:, :n], k)


def _candidates_torch(x: torch.Tensor, k: int, block: int = 256):
    """A superset with torch ops: entries above the running maximum of earlier
    blocks' k-th largest values (a lower bound of the k-th largest of the prefix),
    and every entry of the first block."""
    rows, n = x.shape
    if k == 0 or n == 0:
        return (torch.empty(rows, 0, dtype=torch.long, device=x.device),
                torch.zeros(rows, dtype=torch.long, device=x.device))
    blocks = math.ceil(n / block)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * block - n), value=-math.inf)
    kth = padded.view(rows, blocks, block).topk(min(k, block), dim=-1).values[..., -1]
    bound = torch.cat([torch.full((rows, 1), -math.inf, device=x.device),
                       kth.cummax(-1).values[:, :-1]], 1)
    take = (padded > bound.repeat_interleave(block, dim=1))[:, :n]
    take[:, :min(block, n)] = True
    counts = take.sum(-1)
    most = int(counts.max())
    order = torch.arange(n, device=x.device).expand(rows, n)
    idx = torch.where(take, order, n).sort(-1).values[:, :most]
    return torch.where(idx == n, -1, idx), counts


def heap_topk(proxy: torch.Tensor, k: int):
    """proxy [rows, width]: each row's candidates in row order, -inf in unused slots
    after the first k (a -inf past the initial heap never enters it). torch.topk over
    the rows they came from: (values [rows, k], positions [rows, k] into proxy)."""
    width = proxy.shape[-1]
    if width < 64 * k:  # keep torch.topk on its partial_sort path, as on the full row
        proxy = torch.nn.functional.pad(proxy, (0, 64 * k - width), value=-math.inf)
    return torch.topk(proxy, k, dim=-1)


def count_logprob_ge(x: torch.Tensor, n: int, big_m: torch.Tensor, log_s: torch.Tensor,
                     t: torch.Tensor) -> torch.Tensor:
    """Per row, how many of x[:, :n] have (x - M) - L >= t, in float32 as torch's
    CPU log_softmax computes (x - M) - L. M, L, t: float32 [rows]."""
    m, xs = _scan(x, n)
    if m is not None:
        return m.count_logprob_ge(xs, n, big_m.contiguous(), log_s.contiguous(), t.contiguous())
    x = x[:, :n].float()
    return (((x - big_m[:, None]) - log_s[:, None]) >= t[:, None]).sum(-1)
