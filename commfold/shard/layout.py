"""Which vocab columns each rank verifies in commfold.vllm.spec_decode.shard_verify - V2's
8192-column blocks, each owned by the rank holding most of it, and the columns its
neighbours lend for blocks a shard end splits - and what the verification sends for
a layout: plain arithmetic on (shard, vocab, world), the same on every rank, kept
apart so the pick's cost rule (and the sampled drafter, which fills the columns the
verification reads) can weigh a layout without importing the verification.
"""
from __future__ import annotations

import torch

from commfold.shard.comm import Comm

BLOCK = 8192  # V2's rejection_sample's VOCAB_BLOCK_SIZE (pinned in verify_kernels)


class Layout:
    """Which 8192-column blocks of the vocab each rank computes, and the columns it
    needs from its neighbours to do so - the same on every rank (shard size, vocab).

    A block belongs to the rank holding most of its columns (the first such rank on a
    tie), so a block split by a shard end costs the smaller part. ``head[p]`` /
    ``tail[p]``: how many of rank p's first / last real columns another rank's blocks
    run into."""

    def __init__(self, shard: int, vocab: int, world: int):
        self.shard, self.vocab, self.world = shard, vocab, world
        self.blocks = -(-vocab // BLOCK)
        owner = []
        for b in range(self.blocks):
            lo, hi = b * BLOCK, min((b + 1) * BLOCK, vocab)
            held = [max(0, min(hi, (q + 1) * shard) - max(lo, q * shard))
                    for q in range(world)]
            owner.append(held.index(max(held)))  # non-decreasing in b
        self.first = [sum(o < q for o in owner) for q in range(world)] + [self.blocks]
        self.head, self.tail = [0] * world, [0] * world
        for q in range(world):
            lo, hi = self.span(q)
            for p in range(world):
                s, e = self.columns(p)
                if p == q or min(hi, e) <= max(lo, s):
                    continue
                if p > q:
                    self.head[p] = max(self.head[p], min(hi, e) - s)
                else:
                    self.tail[p] = max(self.tail[p], e - max(lo, s))

    def span(self, rank: int) -> tuple[int, int]:
        """The global columns [lo, hi) of this rank's blocks."""
        return self.first[rank] * BLOCK, min(self.first[rank + 1] * BLOCK, self.vocab)

    def columns(self, rank: int) -> tuple[int, int]:
        """The global columns [start, end) of this rank's real (unpadded) logits."""
        start = rank * self.shard
        return start, max(start, min(start + self.shard, self.vocab))

    def width(self) -> int:
        """The columns each rank sends in the exchange of heads and tails."""
        return max(self.head) + max(self.tail)


def sent(lay: Layout, rank: int, shard: torch.Tensor) -> torch.Tensor:
    """What `rank` sends in the exchange: its first lay.head[rank] columns at the
    front, its last lay.tail[rank] real columns at the back, zeros between."""
    width, n, t = lay.width(), lay.head[rank], lay.tail[rank]
    start, end = lay.columns(rank)
    out = shard.new_zeros(shard.shape[0], width)
    out[:, :n] = shard[:, :n]
    if t:
        out[:, width - t:] = shard[:, end - start - t:end - start]
    return out


def whole_blocks(comm: Comm, lay: Layout, shard: torch.Tensor) -> torch.Tensor:
    """This rank's blocks [rows, hi - lo] of raw logits: its own columns and, where a
    block runs past the shard, the neighbours' columns (one all-gather of every rank's
    head and tail, where any is needed: the same on every rank)."""
    rank, world = comm.rank(), comm.world_size()
    lo, hi = lay.span(rank)
    start, end = lay.columns(rank)
    width = lay.width()
    own = shard[:, max(lo, start) - start:max(min(hi, end), lo, start) - start]
    if not width:  # every rank alike: no block crosses a shard end
        return own if hi > lo else shard[:, :0]
    # every rank sends, a rank holding no block too (a vocab of fewer blocks than ranks)
    got = comm.all_gather(sent(lay, rank, shard)).view(world, shard.shape[0], width)
    if hi <= lo:
        return shard[:, :0]
    parts = []
    for p in range(world):
        s, e = lay.columns(p)
        a, b = max(lo, s), min(hi, e)
        if b <= a:
            continue
        if p == rank:
            parts.append(own)
        elif p < rank:  # p's tail: its columns [e - tail, e) end the buffer
            parts.append(got[p, :, width - (e - a):width - (e - b)])
        else:  # p's head: its columns [s, s + head) start the buffer
            parts.append(got[p, :, a - s:b - s])
    return torch.cat(parts, dim=1)


def exchanged_bytes(rows: int, reqs: int, shard: int, vocab: int, world: int,
                    itemsize: int, draft_logits: bool, min_p: bool = False,
                    processed: bool = False, whole_rows: int = 0) -> int:
    """What one rank sends in verify()'s collectives for a step of `rows` logits rows
    and `reqs` requests (raw logits of `itemsize` bytes; vLLM's gather sends
    rows * shard * itemsize); min_p: a request of the step uses it; processed: V2
    processes the step's logits (the borrowed columns then go as float32);
    whole_rows: rows made whole for vLLM's top-k / top-p kernel (float32 columns).
    The bounds' own exchange (top-k / top-p) is not counted."""
    lay = Layout(shard, vocab, world)
    top = max(lay.first[q + 1] - lay.first[q] for q in range(world))
    k = 4 if draft_logits else 2
    item = 4 if processed else itemsize
    return rows * lay.width() * item + rows * ((k + 2) * top + 2 + min_p) * 4 + \
        reqs * 16 + whole_rows * shard * 4


NO_SAVING = ("a vocab whose 8192-column blocks split this way sends no fewer bytes from "
             "the shards than vLLM's gather")


def no_saving(shard: int, vocab: int, world: int, itemsize: int) -> str | None:
    """Why verifying a row of this layout from the shards sends no fewer bytes than
    vLLM's gather of it (`shard` columns of `itemsize` bytes): the columns borrowed
    for split blocks (float32 where V2 processes the logits) and the per-block stats,
    at their most, reach a shard's worth - small vocabularies, whose few blocks span
    most of a shard; None otherwise. The same on every rank."""
    most = exchanged_bytes(1, 0, shard, vocab, world, itemsize, True, True, True)
    return NO_SAVING if most >= shard * itemsize else None

