"""commfold::local_argmax - greedy pick over vocab-sharded logits without gathering them.

Each rank takes the first maximum of its valid columns (padding past the true vocab
masked out), the ranks exchange one (value, global index) pair per row, and the
first maximum over ranks wins. Shards are contiguous in rank order, so "first over
ranks, then first within a shard" is exactly torch.argmax's rule on the full row,
NaN included (a NaN is the maximum; the first NaN wins). Values travel bit-cast
inside an int64 pair with their index: one collective, no float round trip of
indices.
"""
from __future__ import annotations

import torch

from ..collectives import communicator

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16, torch.float64: torch.int64}

SUPPORTED_DTYPES = tuple(_BITS)


@torch.library.custom_op("commfold::local_argmax", mutates_args=())
def local_argmax(shard: torch.Tensor, valid_vocab: int | None, comm: str,
                 keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(max value, global argmax) over the last dim of gathered[..., :valid_vocab],
    the ranks' shards [..., Vs] concatenated in rank order. valid_vocab is a slice
    end with Python's rules (negative counts from the end); None keeps all columns."""
    c = communicator(comm)
    world, rank = c.world_size(), c.rank()
    vs = shard.shape[-1]
    total = _slice_end(valid_vocab, world * vs)
    if total == 0:
        raise RuntimeError("commfold.local_argmax: argmax over an empty vocab slice "
                           "(the original program's argmax raises here too)")
    lead = shard.shape[:-1]
    rows = shard.reshape(-1, vs)
    n_local = max(0, min(vs, total - rank * vs))
    if n_local > 0 and rows.shape[0] > 0:
        value, index = rows[:, :n_local].max(dim=-1)
    else:  # this rank holds only padding: never chosen over a real column
        value = torch.full(rows.shape[:1], float("-inf"), dtype=rows.dtype)
        index = torch.zeros(rows.shape[:1], dtype=torch.int64)
    pair = torch.stack([value.view(_BITS[rows.dtype]).to(torch.int64),
                        index + rank * vs], dim=-1)
    pairs = c.all_gather(pair).view(world, -1, 2)
    values = pairs[..., 0].to(_BITS[rows.dtype]).view(rows.dtype)  # [world, rows]
    winner = values.argmax(dim=0, keepdim=True)  # first max / first NaN over ranks
    best_value = values.gather(0, winner).reshape(lead)
    best_index = pairs[..., 1].gather(0, winner).reshape(lead)
    if keepdim:
        best_value, best_index = best_value.unsqueeze(-1), best_index.unsqueeze(-1)
    return best_value, best_index


def _slice_end(end: int | None, width: int) -> int:
    if end is None:
        return width
    return max(0, min(width, end if end >= 0 else width + end))


@local_argmax.register_fake
def _(shard, valid_vocab, comm, keepdim=False):
    shape = list(shard.shape[:-1]) + ([1] if keepdim else [])
    return shard.new_empty(shape), shard.new_empty(shape, dtype=torch.int64)
