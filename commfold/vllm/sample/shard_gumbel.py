"""Model Runner V2's Gumbel-max draw over one rank's vocab shard, with V2's own noise.

V2 samples (``gumbel_sample``) by adding to each logit a Gumbel noise that
``gumbel_noised_argmax`` derives from a hash of (request seed, position, token id) -
counter-based, so a token's noise does not depend on where in the row, or on which
rank, it is drawn. This kernel calls that very jit function on the shard's columns
with the keys set to the global token ids (shard start + column): every rank gets
exactly the noised values V2 computes for its columns, and the (value, index) of
each 1024-column block's first maximum. ``block_maxima`` returns this rank's first
maximum per row; the ranks' pairs, first maximum over ranks, are V2's token
(commfold.vllm.sample.sampled_pick; the speculator's draft, commfold.vllm.spec_decode.draft_sampled,
with V2's drafting flags).

vLLM and Triton are imported at the first call, not at import (commfold imports
without them): the kernel is jitted then, with vLLM's ``tl`` and
``gumbel_noised_argmax`` put in this module's globals, where Triton resolves a
kernel's names. From vLLM 0.33 a drafting draw salts the request's seed with the
draft step (V2's ``spec_step_seed``, called here where the caller asks for it).
"""
from __future__ import annotations

from typing import Any

import torch

tl: Any = None  # vllm.triton_utils.tl, set by _kernel()
gumbel_noised_argmax: Any = None  # V2's jit function, set by _kernel()
spec_step_seed: Any = None  # V2's (vLLM 0.33 on) or _unsalted, set by _kernel()
BLOCK = 1024  # V2's gumbel_sample block (any width gives the same first maximum)
_jitted: list = []  # the jitted kernel, once


def _kernel():
    if not _jitted:
        from vllm.triton_utils import tl, triton
        from vllm.v1.worker.gpu.sample import gumbel

        salt = getattr(gumbel, "spec_step_seed", None) or triton.jit(_unsalted)
        globals().update(tl=tl, gumbel_noised_argmax=gumbel.gumbel_noised_argmax,
                         spec_step_seed=salt)
        _jitted.append(triton.jit(_shard_gumbel_kernel))
    return _jitted[0]


def _unsalted(seed, step):
    """Where V2 has no ``spec_step_seed`` (0.32): a name for the kernel's untaken
    branch to resolve."""
    return seed


def _shard_gumbel_kernel(idx_ptr, idx_stride, max_ptr, max_stride, logits_ptr,
                         logits_stride, mapping_ptr, seeds_ptr, pos_ptr, temp_ptr,
                         n_valid, start, step, BLOCK_SIZE: tl.constexpr,
                         USE_FP64: tl.constexpr, IS_DRAFTING: tl.constexpr,
                         APPLY_TEMPERATURE: tl.constexpr, STEP_SEED: tl.constexpr):
    token_idx = tl.program_id(0).to(tl.int64)
    block_idx = tl.program_id(1)
    col = block_idx * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = col < n_valid
    logits = tl.load(logits_ptr + token_idx * logits_stride + col, mask=mask,
                     other=float("-inf")).to(tl.float32)
    # what V2's gumbel_block_argmax loads for the row (its logits cache: the caller's)
    req = tl.load(mapping_ptr + token_idx).to(tl.int64)
    valid = req >= 0
    temp = tl.load(temp_ptr + req, mask=valid, other=0.0).to(tl.float32)
    seed = tl.load(seeds_ptr + req, mask=valid, other=0)
    if STEP_SEED:
        seed = spec_step_seed(seed, step)
    pos = tl.load(pos_ptr + token_idx)
    value, idx = gumbel_noised_argmax(logits, col + start, mask, seed, pos, temp,
                                      IS_DRAFTING=IS_DRAFTING, USE_FP64=USE_FP64,
                                      APPLY_TEMPERATURE=APPLY_TEMPERATURE)
    tl.store(idx_ptr + token_idx * idx_stride + block_idx,
             start + block_idx * BLOCK_SIZE + idx)
    tl.store(max_ptr + token_idx * max_stride + block_idx, value)


def block_maxima(logits: torch.Tensor, start: int, expanded_idx_mapping: torch.Tensor,
                 temperature: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                 use_fp64: bool = False, drafting: bool = False, step: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, global token id) of this rank's first Gumbel-noised maximum per row of
    `logits` [rows, n_valid] (this rank's real columns, processed as V2 processes the
    row; temperature already applied, as V2's Sampler applies it before drawing).
    temperature / seeds: V2's per-request arrays; pos: each row's position.
    drafting: as V2's speculator draws (``is_drafting=True``: the draft's noise
    stream; ``apply_temperature=True``: the kernel divides the raw logits itself).
    step: the draft step (its cache column) to salt the seeds with, as V2 does from
    0.33 when it caches draft logits; None: no salt."""
    rows, n_valid = logits.shape
    kernel = _kernel()
    blocks = max(1, -(-n_valid // BLOCK))
    dtype = torch.float64 if use_fp64 else torch.float32
    local_max = logits.new_empty(rows, blocks, dtype=dtype)
    local_idx = logits.new_empty(rows, blocks, dtype=torch.int64)
    if rows:
        kernel[(rows, blocks)](
            local_idx, local_idx.stride(0), local_max, local_max.stride(0), logits,
            logits.stride(0), expanded_idx_mapping.contiguous(), seeds, pos.contiguous(),
            temperature, n_valid, start, step or 0, BLOCK_SIZE=BLOCK, USE_FP64=use_fp64,
            IS_DRAFTING=drafting, APPLY_TEMPERATURE=drafting, STEP_SEED=step is not None)
    best = local_max.argmax(dim=-1, keepdim=True)  # the first block holding the max
    return local_max.gather(-1, best).squeeze(-1), local_idx.gather(-1, best).squeeze(-1)
