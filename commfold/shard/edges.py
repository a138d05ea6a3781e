"""Rows of a step made whole from every rank's columns, and what that may cost.

Where the bounds of a top-k / top-p cut (commfold.shard.bounds) leave a row in doubt,
the row is rebuilt whole on every rank - one all-gather of its float32 columns - for
the engine's own kernel to cut (commfold.vllm.sample.shard_edge_rows). That pays only
for a few rows: ``over_budget`` allows up to half the bytes of the engine's gather of
the step's raw logits. Plain gathers and byte counts, the same on every rank.
"""
from __future__ import annotations

import torch

from commfold.shard.comm import Comm

BYTES = 2  # the rows made whole cost at most 1 / BYTES of vLLM's gather (float32
# columns against its raw ones: a quarter of a bfloat16 step's rows, half a float32's)


def over_budget(doubtful: int, rows: int, itemsize: int) -> str | None:
    """Why `doubtful` rows of a step of `rows` logits rows (raw logits of `itemsize`
    bytes: vLLM's gather sends rows * shard * itemsize per rank) cost too much to make
    whole, else None."""
    if doubtful * 4 * BYTES > rows * itemsize:
        return (f"top-k / top-p: a token at the cut's edge in {doubtful} of {rows} rows "
                f"(made whole up to {rows * itemsize // (4 * BYTES)}: half the bytes of "
                "vLLM's gather)")
    return None


def gathered_bytes(doubtful: int, shard: int) -> int:
    """What one rank sends to make `doubtful` rows whole (float32 columns)."""
    return doubtful * shard * 4


def whole(comm: Comm, work: torch.Tensor, which: torch.Tensor, shard: int,
          vocab: int) -> torch.Tensor:
    """The rows `which` (the same on every rank) of every rank's processed real columns
    `work` [rows, n_local] (float32), whole: [d, vocab] contiguous, as V2 holds them.
    One all-gather of [d, shard] float32 per rank; every rank calls it together."""
    world = comm.world_size()
    d, n = which.numel(), work.shape[1]
    mine = work.new_full((d, shard), float("-inf"), dtype=torch.float32)
    mine[:, :n] = work[which]
    got = comm.all_gather(mine).view(world, d, shard)
    return got.permute(1, 0, 2).reshape(d, world * shard)[:, :vocab].contiguous()
