"""What ranks exchange to pick one token per row from vocab shards, and how the first
maximum over the row is read back from it.

Each rank holds a contiguous range of the vocab, in rank order, so a row's first
maximum (argmax's, ties to the lowest id) is the first maximum of the first rank
holding the row's largest value: every rank sends one (value, token id) pair per row,
the value's bits carried in an integer so that the exchange keeps them exactly (NaN
payloads, -0.0, -inf), and every rank reads the same answer from the same gathered
words. Any mix of dtypes travels in one all-gather as int32 words (``exchange``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from commfold.shard.comm import Comm
from commfold.shard.layout import Layout, sent

BITS = {torch.float32: torch.int32, torch.float64: torch.int64}  # a value's bits


def value_bits(value: torch.Tensor) -> torch.Tensor:
    """The bits of float32 / float64 `value` as int64 (a float32's sign-extended)."""
    return value.view(BITS[value.dtype]).to(torch.int64)


def bits_value(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """value_bits' inverse: int64 -> the values of `dtype`, bit for bit."""
    return bits.to(BITS[dtype]).view(dtype)


def first_rank(values: torch.Tensor) -> torch.Tensor:
    """[1, rows]: the first rank holding each row's maximum of `values` [world, rows]
    (NaN-free: torch's argmax takes a NaN as the maximum)."""
    return values.argmax(dim=0, keepdim=True)


class Firsts(NamedTuple):
    tokens: torch.Tensor  # [rows] int64: the global id of each row's first maximum
    # [rows] bool: rows whose rival is not below the maximum (None: no rivals given)
    edge: torch.Tensor | None


def first_max(comm: Comm, value: torch.Tensor, index: torch.Tensor,
              rival: torch.Tensor | None = None) -> Firsts | None:
    """The global index of the first maximum over ranks of each row's (value, index)
    (this rank's first maximum of its columns: value float32 / float64 [rows], index
    its global token id [rows] int64), from one all-gather of an int64 pair per row
    per rank; None where a gathered value is NaN. rival: each row's best value among
    tokens that may or may not count (-inf: none), gathered with the pair; ``edge``
    marks the rows where one is not below the row's maximum. Every rank calls it
    together and gets the same answer."""
    columns = [value_bits(value), index]
    if rival is not None:
        columns.append(value_bits(rival))
    pairs = comm.all_gather(torch.stack(columns, dim=-1)).view(comm.world_size(), -1,
                                                                len(columns))
    values = bits_value(pairs[..., 0], value.dtype)
    if bool(values.isnan().any()):
        return None
    edge = None
    if rival is not None:
        rivals = bits_value(pairs[..., 2], value.dtype).amax(0)
        edge = (rivals >= values.amax(0)) & (rivals > float("-inf"))
    tokens = pairs[..., 1].gather(0, first_rank(values)).squeeze(0)
    return Firsts(tokens, edge)


def nan_as_neg_inf(logits: torch.Tensor) -> torch.Tensor:
    """NaN masked as -inf before a pick (vLLM 0.34's greedy_argmax): elementwise, so
    masking each shard gives the gathered row's mask."""
    return logits.masked_fill(logits.isnan(), float("-inf"))


def words(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] of any dtype as int32 words [rows, ceil(n * itemsize / 4)] (bits kept)."""
    if not x.numel():
        return torch.zeros(x.shape[0], -(-x.shape[1] * x.element_size() // 4),
                           dtype=torch.int32, device=x.device)
    b = x.contiguous().flatten().view(torch.uint8).view(x.shape[0], -1)
    pad = -b.shape[1] % 4
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    return b.view(torch.int32)


def unwords(w: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
    """words()'s inverse: [..., k] int32 -> [..., n] of dtype."""
    size = torch.empty((), dtype=dtype).element_size()
    if not w.numel():
        return torch.zeros(*w.shape[:-1], n, dtype=dtype, device=w.device)
    b = w.contiguous().flatten().view(torch.uint8).view(*w.shape[:-1], -1)[..., :n * size]
    return b.contiguous().flatten().view(dtype).view(*w.shape[:-1], n)


def exchange(comm: Comm, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's `parts` ([rows, n_i] each, any dtype; the same shapes on every
    rank) from one all-gather of int32 words: [world, rows, n_i] each, bit for bit."""
    packed = [words(p) for p in parts]
    rows = parts[0].shape[0]
    got = comm.all_gather(torch.cat(packed, dim=1)).view(comm.world_size(), rows, -1)
    out, at = [], 0
    for p, w in zip(parts, packed):
        out.append(unwords(got[..., at:at + w.shape[1]], p.dtype, p.shape[1]))
        at += w.shape[1]
    return out


def draft_parts(value: torch.Tensor, index: torch.Tensor, raw: torch.Tensor,
                lay: Layout, rank: int, shard: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What a rank sends per row for a sampled draft step (commfold.vllm.spec_decode.
    draft_sampled): its first noised maximum's value and token id, the raw logit at
    it, and the columns its neighbours verify (`lay`'s heads and tails of `shard`)."""
    return value[:, None], index[:, None], raw, sent(lay, rank, shard)


@functools.cache
def draft_bytes(rows: int, shard: int, vocab: int, world: int, itemsize: int,
                fp64: bool = False) -> int:
    """What one rank sends per draft step of `rows` rows (draft_parts as int32 words;
    vLLM's gather sends rows * shard * itemsize)."""
    lay = Layout(shard, vocab, world)
    per_row = (2 if fp64 else 1) + 2 + -(-itemsize // 4) + -(-lay.width() * itemsize // 4)
    return rows * per_row * 4
