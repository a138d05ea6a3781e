"""V2's four rejection-sampling kernels launched as the installed vLLM's
``rejection_sample`` launches them, for commfold.vllm.spec_decode.shard_verify.

The kernels' argument lists differ by release (vLLM 0.33: the stats kernel counts
the step's logits rows, ``num_logits``, where 0.32 passed the speculative steps, and
the rejection kernel takes FLy's entropy and window; 0.34: every kernel reading
draft logits takes the DraftLogitsCache's row mapping, the resample kernel whether
a request may mask logits, the insert kernel one warp). Each launch here names its
arguments and adds a release's own where this vLLM is read as that release (``form``:
commfold.vllm.compat.releases.here; the pins hold for it), with the values
``rejection_sample`` passes for a "standard" verification of a replicated draft
cache: no FLy window, no block verification, no synthetic rates, no watermark, no
row mapping. Any other source leaves the mode off (``POINTS``, read by
shard_verify.moved()).

What the kernels call is pinned with them where it reads the logits commfold
builds (the combine of the blocks, the draft-token logit, the Gumbel draw).
Helpers that are given only index arrays - 0.33's ``_is_bonus_logit``
(expanded_local_pos), 0.34's ``draft_logits_row`` (the row mapping, None here) and
0.33's ``spec_step_seed`` (block verification and the drafter's cache only) - get
the same arguments in commfold's launch as in V2's, so they give the same result
whatever they compute; they are not in 0.32, so they are not pinned.
"""
from __future__ import annotations


import torch

from commfold.shard.layout import BLOCK  # rejection_sample's VOCAB_BLOCK_SIZE
from commfold.vllm.compat import pins, releases

RESAMPLE_BLOCK = 1024  # its RESAMPLE_BLOCK_SIZE
_U = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils:"
# each function's whole source, pinned per release (pins.json)
_SOURCES = (
    "rejection_sample",
    "_compute_local_logits_stats_kernel",
    "_compute_max_and_sumexp",
    "_rejection_kernel",
    "_compute_global_logsumexp",
    "_compute_global_logprobs_and_logsumexp",
    "_compute_global_target_argmax",
    "_resample_kernel",
    "_seeded_resample_argmax",
    "_insert_resampled_kernel",
)
POINTS = tuple((_U + name, pins.pinned(_U + name)) for name in _SOURCES)


def form() -> tuple[int, ...]:
    """The release whose argument lists the launches pass: the one this vLLM is read
    as (releases.here). Its kernels' pins hold for that release, or shard_verify.moved()
    refuses the mode before any launch."""
    return releases.here().numbers or ()


def values(draft_logits):
    """The drafter's cached logits [reqs, steps, vocab] V2's kernels read: up to 0.33
    the cache itself, from 0.34 a DraftLogitsCache's ``values``; None without."""
    if draft_logits is None or isinstance(draft_logits, torch.Tensor):
        return draft_logits  # (a tensor's own `values` is a method)
    return draft_logits.values


def sharded(draft_logits) -> bool:
    """Whether the cache is 0.34's batch-sharded one (each rank holds only the
    requests it verifies): commfold needs every request's logits on every rank."""
    return getattr(draft_logits, "row_mapping", None) is not None


def stats(grid, t_arg, t_max, t_sum, d_max, d_sum, logits, vocab_size: int, draft,
          mapping, local_pos, temp, steps: int) -> None:
    """``_compute_local_logits_stats_kernel`` on `logits` (rows: the step's logits
    rows) and `draft` (the cached draft logits, already offset to the buffer's
    first column, or None)."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as ru

    kw = dict(
        target_local_argmax_ptr=t_arg, target_local_argmax_stride=t_arg.stride(0),
        target_local_max_ptr=t_max, target_local_max_stride=t_max.stride(0),
        target_local_sumexp_ptr=t_sum, target_local_sumexp_stride=t_sum.stride(0),
        draft_local_max_ptr=d_max, draft_local_max_stride=d_max.stride(0),
        draft_local_sumexp_ptr=d_sum, draft_local_sumexp_stride=d_sum.stride(0),
        target_logits_ptr=logits, target_logits_stride=logits.stride(0),
        **_draft(draft), expanded_idx_mapping_ptr=mapping,
        expanded_local_pos_ptr=local_pos, temp_ptr=temp, vocab_size=vocab_size,
        BLOCK_SIZE=BLOCK, HAS_DRAFT_LOGITS=draft is not None)
    at = form()
    if at >= (0, 33):
        kw["num_logits"] = logits.shape[0]
    else:
        kw["num_speculative_steps"] = steps
    if at >= (0, 34):
        kw["draft_logits_row_mapping_ptr"] = None
    ru._compute_local_logits_stats_kernel[grid](**kw)


def rejection(rejection_sampler, sampled, num_sampled, t_lse, d_lse, target, argmax,
              t_max, t_sum, draft_sampled, draft, d_max, d_sum, cu, idx_mapping, temp,
              seeds, pos, blocks: int, padded: int) -> None:
    """``_rejection_kernel`` over the step's requests, "standard" verification."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as ru

    kw = dict(
        sampled_ptr=sampled, sampled_stride=sampled.stride(0), rejected_steps_ptr=num_sampled,
        target_rejected_logsumexp_ptr=t_lse, draft_rejected_logsumexp_ptr=d_lse,
        target_logits_ptr=target, target_logits_stride=target.stride(0),
        target_local_argmax_ptr=argmax, target_local_argmax_stride=argmax.stride(0),
        target_local_max_ptr=t_max, target_local_max_stride=t_max.stride(0),
        target_local_sumexp_ptr=t_sum, target_local_sumexp_stride=t_sum.stride(0),
        draft_sampled_ptr=draft_sampled, **_draft(draft),
        draft_local_max_ptr=d_max, draft_local_max_stride=d_max.stride(0),
        draft_local_sumexp_ptr=d_sum, draft_local_sumexp_stride=d_sum.stride(0),
        cu_num_logits_ptr=cu, idx_mapping_ptr=idx_mapping, temp_ptr=temp, seed_ptr=seeds,
        pos_ptr=pos, synthetic_conditional_rates_ptr=None, cumulative_log_p_ptr=None,
        local_residual_mass_ptr=None, local_residual_mass_stride=0,
        vocab_num_blocks=blocks, PADDED_VOCAB_NUM_BLOCKS=padded,
        HAS_DRAFT_LOGITS=draft is not None, SYNTHETIC_MODE=False,
        USE_BLOCK_VERIFICATION=False, num_warps=1)
    at = form()
    if at >= (0, 33):  # FLy off: V2 passes its threshold all the same
        kw.update(fly_entropy_ptr=None,
                  fly_entropy_threshold=rejection_sampler.fly_entropy_threshold,
                  FLY_WINDOW_SIZE=0)
    if at >= (0, 34):
        kw["draft_logits_row_mapping_ptr"] = None
    ru._rejection_kernel[(sampled.shape[0],)](**kw)


def resample(sampler, idx_mapping_np, r_idx, r_val, target, t_lse, draft, d_lse,
             num_sampled, cu, mapping, draft_sampled, temp, seeds, pos, vocab_size: int,
             use_fp64: bool) -> None:
    """``_resample_kernel`` over [requests, 1024-column blocks of vocab_size]."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as ru

    kw = dict(
        resampled_local_argmax_ptr=r_idx, resampled_local_argmax_stride=r_idx.stride(0),
        resampled_local_max_ptr=r_val, resampled_local_max_stride=r_val.stride(0),
        target_logits_ptr=target, target_logits_stride=target.stride(0),
        target_rejected_logsumexp_ptr=t_lse, **_draft(draft),
        draft_rejected_logsumexp_ptr=d_lse, rejected_step_ptr=num_sampled,
        cu_num_logits_ptr=cu, expanded_idx_mapping_ptr=mapping,
        draft_sampled_ptr=draft_sampled, temp_ptr=temp, seed_ptr=seeds, pos_ptr=pos,
        cumulative_log_p_ptr=None, contexts_ptr=None, contexts_stride=0,
        watermarking_ptr=None, watermarking_skip_mask_ptr=None, watermark_key_0=0,
        watermark_key_1=0, vocab_size=vocab_size, BLOCK_SIZE=RESAMPLE_BLOCK,
        HAS_DRAFT_LOGITS=draft is not None, USE_FP64=use_fp64,
        USE_BLOCK_VERIFICATION=False, CONTEXT_WIDTH=1, WATERMARK=False,
        DEDUPLICATE_CONTEXTS=False)
    if form() >= (0, 34):
        # V2's flag for the step (its _verify: any request whose processing may mask
        # logits); per chunk in V2, but it changes only a block whose target logits
        # are all -inf, which draws -inf either way
        kw.update(draft_logits_row_mapping_ptr=None, SKIP_MASKED_BLOCKS=bool(
            sampler.may_mask_logits[idx_mapping_np].any()))
    ru._resample_kernel[tuple(r_idx.shape)](**kw)


def insert(sampled, num_sampled, tokens, values_, cu, mapping, temp, padded: int) -> None:
    """``_insert_resampled_kernel``: the first maximum of each request's candidates."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as ru

    kw = dict(
        sampled_ptr=sampled, sampled_stride=sampled.stride(0), num_sampled_ptr=num_sampled,
        resampled_local_argmax_ptr=tokens, resampled_local_argmax_stride=tokens.stride(0),
        resampled_local_max_ptr=values_, resampled_local_max_stride=values_.stride(0),
        resample_num_blocks=tokens.shape[1], cu_num_logits_ptr=cu,
        expanded_idx_mapping_ptr=mapping, temp_ptr=temp, PADDED_RESAMPLE_NUM_BLOCKS=padded)
    if form() >= (0, 34):
        kw["num_warps"] = 1  # rejection_sample's launch from 0.34 (the kernel is 0.32's)
    ru._insert_resampled_kernel[(tokens.shape[0],)](**kw)


def _draft(draft) -> dict:
    """The draft-logits pointer and strides every kernel takes."""
    s0, s1 = (draft.stride(0), draft.stride(1)) if draft is not None else (0, 0)
    return dict(draft_logits_ptr=draft, draft_logits_stride_0=s0, draft_logits_stride_1=s1)
