"""Which drafted tokens a verified spec-decode step keeps, from each row's target
token: the strict greedy rule, and the token scored at each logits row after.

Under greedy verification a request's draft is accepted while each drafted token
equals the target's argmax at the row before it and is no placeholder (-1); the
first rejected position, or the bonus one past the drafts, takes the target's
argmax. Given the target's argmax per logits row (the first maximum over the ranks'
shards, commfold.shard.payload), every rank applies the rule to the same values:
index arithmetic on the step's layout (``cu_np``: the cumulative logits rows per
request), kept apart from the engine objects that hold the drafts
(commfold.vllm.target.v2_pick reads them).
"""
from __future__ import annotations

import torch


def greedy(draft: torch.Tensor, argmax: torch.Tensor, cu_np, reqs: int,
           steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """V2's strict greedy verification (its rejection kernel's greedy rule):
    (sampled [reqs, steps + 1] int64, num_sampled [reqs] int32) from `draft` [rows],
    each logits row's token as V2's gather_draft_sampled gives it (row i + 1's is the
    draft row i verifies; a request's first row's is never read; -1: a placeholder,
    rejected), and the target's `argmax` [rows] int64; `cu_np`: [reqs + 1]
    cumulative logits rows per request."""
    cu = torch.as_tensor(cu_np, dtype=torch.int64)
    counts = (cu[1:] - cu[:-1]).to(argmax.device)
    req = torch.repeat_interleave(torch.arange(reqs, device=argmax.device), counts)
    col = torch.arange(argmax.shape[0], device=argmax.device) - cu.to(argmax.device)[req]
    nxt = torch.cat([draft[1:], draft.new_full((1,), -1)]).to(argmax.dtype)
    bonus = col == (counts - 1)[req]
    ok = (argmax == nxt) & (nxt >= 0) & ~bonus
    accepted = torch.zeros(reqs, steps + 1, dtype=torch.bool, device=argmax.device)
    target = torch.zeros(reqs, steps + 1, dtype=torch.int64, device=argmax.device)
    drafts = torch.zeros_like(target)
    accepted[req, col], target[req, col], drafts[req, col] = ok, argmax, nxt
    length = accepted.to(torch.int32).cumprod(1).sum(1)  # drafts accepted per request
    cols = torch.arange(steps + 1, device=argmax.device)
    sampled = torch.where(cols < length[:, None], drafts, target)
    return sampled, (length + 1).to(torch.int32)


def verified_tokens(sampled: torch.Tensor, num_sampled: torch.Tensor, cu_np) -> torch.Tensor:
    """The token V2's RejectionSampler scores at each logits row of a verified step
    (its _flatten_sampled_kernel): request r's row i holds sampled[r, i] for i below
    its num_sampled (before V2 counts the rejected), 0 past them."""
    cu = torch.as_tensor(cu_np, dtype=torch.int64, device=sampled.device)
    counts = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(counts.shape[0], device=sampled.device),
                                  counts)
    col = torch.arange(int(cu[-1]), device=sampled.device) - cu[req]
    kept = col < num_sampled.to(torch.int64)[req]
    return torch.where(kept, sampled[req, col.clamp(max=sampled.shape[1] - 1)], 0)
