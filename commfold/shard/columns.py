"""A request's per-vocab state in a shard's columns: what a rank hands an engine's
per-column kernel so that it does on the shard what it does on the full row.

Engines keep such state over the whole vocab - token id lists (allowed ids, logit
bias, stop ids) and packed bit masks (a prompt's tokens, a grammar's allowed tokens:
token t at bit t % 32 of int32 word t // 32). A kernel given the shard's columns as
its logits must see the ids as shard columns and the bits of token start + j at
column j; a shard that starts inside a 32-token word needs its masks shifted across
words. Plain index arithmetic, the same on every rank.
"""
from __future__ import annotations

import torch


def shard_ids(counts, ids: torch.Tensor, slots, start: int, n: int, spare: bool = False,
              values: torch.Tensor | None = None):
    """(counts [max_reqs] int32, ids, values) of V2's per-request token id lists
    (ids [max_reqs, max] int32, the first counts[slot] of a row used; values beside
    them) with only the ids in [start, start + n), as shard columns, for `slots`.
    spare: a slot with ids but none here gets column n (one past the shard)."""
    out_n = torch.zeros(ids.shape[0], dtype=torch.int32, device=ids.device)
    out = torch.zeros_like(ids)
    out_values = None if values is None else torch.zeros_like(values)
    for slot in slots:
        row = ids[slot, :int(counts[slot])].long()
        keep = (row >= start) & (row < start + n)
        local = row[keep] - start
        if spare and len(row) and not len(local):
            local = row.new_full((1,), n)
        out[slot, :len(local)] = local.to(ids.dtype)
        out_n[slot] = len(local)
        if out_values is not None and values is not None:
            out_values[slot, :len(local)] = values[slot, :len(row)][keep]
    return out_n, out, out_values


def shard_bits(mask: torch.Tensor, start: int, n: int, idx_np) -> torch.Tensor:
    """V2's packed prompt-token bit mask [max_reqs, vocab / 32] (int32, token t at bit
    t % 32 of word t // 32) for the columns [start, start + n): a view where start is
    word-aligned, else re-packed for the step's requests (idx_np: any int sequence,
    V2's numpy array; commfold itself needs no numpy)."""
    q, s = divmod(start, 32)
    if s == 0:
        return mask[:, q:]
    words = -(-n // 32)
    rows = torch.as_tensor(idx_np, dtype=torch.int64, device=mask.device)
    w = torch.nn.functional.pad(mask[rows].to(torch.int64) & 0xFFFFFFFF, (0, 1))
    lo, hi = w[:, q:q + words], w[:, q + 1:q + 1 + words]
    bits = ((lo >> s) | (hi << (32 - s))) & 0xFFFFFFFF
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    out = mask.new_zeros(mask.shape[0], words)
    out[rows] = bits
    return out


def shard_mask(bitmask, start: int, n: int):
    """V2's packed grammar bitmask (numpy int32 [rows, words]) for the columns
    [start, start + n): the same shape, shard column j at bit j % 32 of word j // 32,
    the words past the shard's zero (V2's worker copies it into a buffer of that
    width; its kernel reads no column past the logits it is given). Returned as numpy,
    as V2 holds it (numpy is there: the caller's bitmask is numpy)."""
    full = torch.as_tensor(bitmask, dtype=torch.int32).contiguous()
    words = -(-n // 32)
    out = torch.zeros_like(full)
    out[:, :words] = shard_bits(full, start, n, torch.arange(full.shape[0]))[:, :words]
    return out.numpy()
