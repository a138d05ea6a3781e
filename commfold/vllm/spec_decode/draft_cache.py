"""Model Runner V2's draft logits cache (``speculator.draft_logits``, [max_reqs, steps,
vocab]) as commfold's sampled drafter fills it (commfold.vllm.spec_decode.draft_sampled): on each
rank only the columns that rank's verification reads, and whole rows again for any
reader that needs them.

V2's Gumbel kernel writes a drafted row's logits whole, on every rank (the gathered
logits). commfold's drafter writes, on each rank, its own vocab shard, the neighbours'
columns of the 8192-column blocks it verifies (commfold.shard.layout.Layout: the
stats kernel's reads) and the drafted token's logit (the rejection kernel's read).
Every write, commfold's or V2's, writes the writing rank's own columns, so the owner
of a column always holds its latest value: one all-gather of each rank's own columns
of a row (``complete``) gives back exactly the row V2 would hold. It runs:

- before V2's own RejectionSampler reads the cache (a target step commfold gives back,
  or one it never takes): the step's rows commfold drafted (install wraps
  ``RejectionSampler.__call__``: every rank calls it together, batch-sharded sampling
  being refused by the drafter);
- before commfold's verification, where the filled columns are not the ones it reads
  (its layout differs: another vocab or shard width) or a draft is not the token the
  drafter wrote on every rank (``prepare_verify``).

Which rows are partial (``Filled.dirty``) and which token each step drafted are set
from replicated values (the requests' slots, the gathered tokens): every decision
here is the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from commfold.distributed.collectives import communicator

ATTR = "_commfold_filled"  # the cache tensor's attribute holding its Filled


@dataclass
class Filled:
    comm: str  # the drafter's TP communicator (commfold's spec)
    shard: int  # the drafter's vocab columns per rank
    vocab: int  # the drafter's true vocab: the cache columns V2 writes
    dirty: torch.Tensor  # [max_reqs] bool: slots whose rows some rank holds in part
    tokens: torch.Tensor  # [max_reqs, steps] int64: each step's drafted token (-1: none)


def of(cache: torch.Tensor | None) -> Filled | None:
    return None if cache is None else getattr(cache, ATTR, None)


def filled(cache: torch.Tensor, comm: str, shard: int, vocab: int) -> Filled:
    """The cache's Filled, made on the drafter's first write (its layout fixed then)."""
    found = of(cache)
    if found is None:
        found = Filled(comm, shard, vocab,
                       torch.zeros(cache.shape[0], dtype=torch.bool, device=cache.device),
                       torch.full(cache.shape[:2], -1, dtype=torch.int64, device=cache.device))
        setattr(cache, ATTR, found)
    return found


def record(cache: torch.Tensor | None, slots: torch.Tensor, col: int, tokens: torch.Tensor,
           partial: bool) -> None:
    """Step `col`'s drafted `tokens` of the rows in `slots` (-1 rows skipped, as V2's
    kernel skips them); partial: commfold wrote them (else V2 wrote them whole)."""
    found = of(cache)
    if found is None:
        return
    valid = slots >= 0
    rows = slots[valid].long()
    found.tokens[rows, col] = tokens[valid].long()
    if partial:
        found.dirty[rows] = True


def complete(cache: torch.Tensor | None, slots: torch.Tensor) -> int:
    """Make whole, on every rank, the cache rows of `slots` (a step's request slots)
    that commfold's drafter left partial: one all-gather of each rank's own columns
    of those rows, every step. Returns how many slots were gathered (every rank the
    same). Every rank calls it together."""
    found = of(cache)
    if found is None or cache is None:
        return 0
    slots = torch.unique(slots[slots >= 0].long())
    rows = slots[found.dirty[slots]]
    if not rows.numel():
        return 0
    comm = communicator(found.comm)
    world, start = comm.world_size(), comm.rank() * found.shard
    n = max(0, min(found.shard, found.vocab - start))
    part = cache.new_zeros(rows.numel(), cache.shape[1], found.shard)
    part[..., :n] = cache[rows, :, start:start + n]
    got = comm.all_gather(part).view(world, rows.numel(), cache.shape[1], found.shard)
    whole = got.permute(1, 2, 0, 3).reshape(rows.numel(), cache.shape[1], -1)
    cache[rows, :, :found.vocab] = whole[..., :found.vocab]
    found.dirty[rows] = False
    return int(rows.numel())


def completed_bytes(rows: int, steps: int, shard: int, itemsize: int) -> int:
    """What one rank sends in ``complete`` for `rows` partial slots."""
    return rows * steps * shard * itemsize


def prepare_verify(cache: torch.Tensor | None, shard: int, vocab: int, draft: torch.Tensor,
                   input_batch) -> int:
    """Before commfold's verification of a step reads `cache` with the layout of
    (shard, vocab) (the target's shard width, the columns it verifies): the step's
    rows made whole where the drafter filled another layout, or where a draft
    (`draft`: each logits row's input token, V2's gather_draft_sampled) is not the
    token drafted at that step. Returns the slots gathered (every rank the same)."""
    found = of(cache)
    if found is None:
        return 0
    if (found.shard, found.vocab) != (shard, vocab):
        return complete(cache, input_batch.idx_mapping)
    mapping = input_batch.expanded_idx_mapping.long()
    local = input_batch.expanded_local_pos.long()
    # row j verifies draft local[j] with the next row's input token, same request
    held = (mapping[1:] == mapping[:-1]) & (local[1:] > 0)
    j = held.nonzero()[:, 0]
    slot, step, token = mapping[j], local[j], draft[j + 1].long()
    wrong = found.dirty[slot] & (token >= 0) & (token != found.tokens[slot, step])
    return complete(cache, input_batch.idx_mapping) if bool(wrong.any()) else 0
