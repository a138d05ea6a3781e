"""Model Runner V2's probabilistic verification ("standard" rejection sampling of a
step with sampled requests) from this rank's logits shard, bit for bit as V2's
RejectionSampler, without the full-vocab all-gather.

V2's ``rejection_sample`` works in vocab blocks. Each piece here is V2's own kernel on
inputs that hold, wherever the kernel reads, the values V2's would hold:

- stats: V2's ``_compute_local_logits_stats_kernel`` on this rank's 8192-column blocks
  (the blocks it holds most of). A block split by a shard end is completed with its
  columns from the neighbouring ranks, which every rank sends as the head and tail of
  its shard (one all-gather, only where shard ends are not block-aligned: at most
  4096 columns per row per shard end, shards a block wide or more); the kernel then
  sees every block whole and computes
  V2's per-block max, sum of exponentials, argmax (greedy rows) and the draft's;
- one all-gather of those per-block values (24 bytes per block per row, 40 with
  draft logits) plus, per row, the target logit at the next draft token from the rank
  holding it: every rank then holds V2's per-block arrays whole and runs V2's own
  ``_rejection_kernel`` (its combine of the blocks, in its order; the acceptance
  test ``log p > log u + log q``; greedy rows' argmax) on a target buffer that holds
  only the draft-token entries the kernel reads: the accepted lengths and the
  rejected rows' log-sum-exps come out bit-identical, the same on every rank;
- resampling: V2's ``_resample_kernel`` over the full vocab width with this rank's
  columns of the resampled rows and -inf elsewhere (those lanes draw -inf), the
  Gumbel keys global token ids as in V2's; each rank's first maximum, one (value bits,
  token) pair per request per rank exchanged, and V2's ``_insert_resampled_kernel``
  picks the first maximum over ranks (in column order: V2's first maximum).

Draft probabilities: V2 reads the drafter's cached logits (``speculator.draft_logits``,
[max_reqs, steps, vocab], written by V2's Gumbel kernel from the drafter's gathered
logits: full-vocab and alike on every rank; from vLLM 0.34 the ``values`` of a
DraftLogitsCache, whose batch-sharded form - each rank holding its own requests' -
is refused: ``draft_refusal``) or, without them, a one-hot draft; both are used as
V2 uses them. Target logits are processed as V2 processes them before
verifying (``apply_sampling_params`` but top-k / top-p: penalties with the draft
tokens as V2 passes them, logit bias, allowed ids, min_tokens, bad words,
temperature, min_p) by the sampled draw's own shard processing
(commfold.vllm.sample.sampling_params.process, pinned with the draw); the columns a rank
borrows from its neighbours for a split block are then sent processed (float32).
Top-k / top-p: the bounds of V2's cut (commfold.shard.bounds) mask what
they prove dropped; a row where they leave a token in doubt on any rank (known on
every rank from the bounds' exchange) is made whole and cut by vLLM's own kernel
(commfold.vllm.sample.shard_edge_rows: one all-gather of those rows), since every
probability of a row depends on the kept set; past that module's limit the step is
V2's.
commfold's sampled drafter fills the cache, on each rank, only where this rank
reads it (commfold.vllm.spec_decode.draft_cache).

A step whose shard holds NaN on any rank (a flag in the stats exchange), or whose
resampled values do, returns None on every rank: the step is gathered and V2's
RejectionSampler takes it. The kernels are launched as the installed release launches
them for "standard" verification (commfold.vllm.spec_decode.verify_kernels: vLLM 0.32, 0.33,
0.34); each function used or repeated is pinned by its whole source per release
(``POINTS``): any other source refuses the mode with a line and the step stays V2's,
as do a watermark and a rejection sampler built for another method (``refusal``).
"""
from __future__ import annotations

import functools
import logging
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch

from commfold.distributed.collectives import communicator
from commfold.shard import bounds as shard_bounds
from commfold.shard import edges
from commfold.shard.layout import Layout, whole_blocks
from commfold.shard.payload import bits_value, value_bits
from commfold.vllm.spec_decode import draft_cache, verify_kernels
from commfold.vllm.compat import hook_points, pins, runtime
from commfold.vllm.sample import sampled_pick, sampling_params
from commfold.vllm.observe import step_log
from commfold.vllm.target import switch
from commfold.vllm.target.decision import verify_method, verify_refusal
from commfold.vllm.target.logits_head import LogitsHead

log = logging.getLogger("commfold")

HOOK = "target pick: sampled verification"
RESAMPLE_BLOCK = verify_kernels.RESAMPLE_BLOCK
_R = "vllm.v1.worker.gpu.spec_decode.rejection_sampler:"
_S = "vllm.v1.worker.gpu.sample."
# what verify() calls or repeats besides the kernels it launches (their pins:
# commfold.vllm.spec_decode.verify_kernels), each function's whole source pinned per release
_SOURCES = (
    _R + "gather_draft_sampled",
    _R + "RejectionSampler.__call__",
    _R + "RejectionSampler._verify",
    _R + "RejectionSampler._verify_in_chunks",
    _S + "sampler:Sampler.apply_sampling_params",
    _S + "states:SamplingStates.apply_temperature",
    _S + "states:SamplingStates.apply_min_p",
    _S + "min_p:apply_min_p",
    _S + "min_p:_min_p_kernel",
    _S + "gumbel:gumbel_block_argmax",
)
POINTS = tuple((where, pins.pinned(where)) for where in _SOURCES) + verify_kernels.POINTS


def state(environ=os.environ, runner=None) -> runtime.HookState:
    """Whether sampled spec-decode steps can be verified on the shards (the target
    pick's own switch, COMMFOLD_TARGET_PICK, turns it off with it)."""
    return switch.mode_state(HOOK, POINTS, environ, runner)


def install(environ=os.environ, runner=None) -> bool:
    """Nothing to wrap (the V2 target pick calls verify()): logs the one line."""
    return state(environ, runner).log().on


def uninstall() -> None:
    """Nothing was wrapped."""


@functools.cache  # vLLM's code does not change within a process
def moved() -> str | None:
    """Why sampled verification stays V2's in this process (a point moved), else None."""
    gone = hook_points.missing(POINTS)
    if not gone:
        return None
    log.warning("commfold: %s off: vLLM changed what it repeats: %s", HOOK, "; ".join(gone))
    return f"vLLM changed {gone[0].split(' ')[0]} (commfold doctor)"


def refusal(rejection_sampler) -> str | None:
    """Why this engine's sampled verification stays V2's (engine configuration and
    vLLM's code - what verify() repeats and the draw's processing it borrows: the
    same on every rank), else None: a watermark, or a rejection
    sampler built for another method than "standard" (FLy's window, block
    verification, synthetic rates, adaptive verification: the step decision refuses
    them first, from the speculative config) - verify() launches the kernels as
    "standard" verification launches them."""
    if getattr(rejection_sampler, "watermark_key", None) is not None:
        return "watermarked verification"
    asked = SimpleNamespace(rejection_sample_method="standard")  # what it was built for
    built = verify_method(asked, rejection_sampler)
    if built != "standard":
        return verify_refusal(built)
    return moved() or sampled_pick.refusal()


def draft_refusal(draft_logits) -> str | None:
    """Why a step with these cached draft logits stays V2's (the engine's cache: the
    same on every rank), else None."""
    if verify_kernels.sharded(draft_logits):
        return "batch-sharded draft logits (each rank holds its requests' only)"
    return None


class Verified(NamedTuple):
    sampled: torch.Tensor  # [reqs, steps + 1]: V2's rejection_sample's
    num_sampled: torch.Tensor  # [reqs] int32: before V2 counts the rejected
    processed: torch.Tensor  # [rows, shard]: the shard as V2 processed it (logprobs)


def _cut(comm, head: LogitsHead, target: torch.Tensor, states, input_batch, start: int,
         itemsize: int) -> str | None:
    """V2's top-k / top-p cut on this rank's processed columns `target` (in place): the
    bounds' certain drops on every row, vLLM's kernel on the rows made whole where a
    rank may hold a token between the bounds (every probability of a row depends on
    the kept set); why the step goes to V2 where neither can be had (every rank
    alike). Every rank calls it together."""
    from commfold.vllm.sample import shard_edge_rows

    mapping = input_batch.expanded_idx_mapping
    bounds = shard_bounds.cut(comm, target, states.top_k.gpu[mapping],
                              states.top_p.gpu[mapping], head.vocab, head.shard)
    if isinstance(bounds, str):
        return bounds
    rows = target.shape[0]
    which = bounds.doubt.nonzero()[:, 0]
    exact = None
    if len(which):
        why = shard_edge_rows.refusal(len(which), rows, itemsize)
        if why is not None:
            return why
        whole = edges.whole(comm, target, which, head.shard, head.vocab)
        exact = shard_edge_rows.cut(whole, which, states, input_batch, rows, "states")
    target.masked_fill_(bounds.below(target), float("-inf"))  # V2's cut, where it is certain
    if exact is not None:  # ... and where it is not, vLLM's kernel's
        target[which] = exact[:, start:start + target.shape[1]]
        step_log.note(shard_edge_rows.NOTE_KEY, shard_edge_rows.note(len(which)))
    return None


def verify(rejection_sampler, head: LogitsHead, shard: torch.Tensor, input_batch,
           draft_logits: torch.Tensor | None,
           invalid_drafts: torch.Tensor | None = None) -> Verified | str:
    """The step's verification as V2's RejectionSampler's ``rejection_sample`` gives
    it, from this rank's `shard` [rows, head.shard]; why the step goes to V2 where a
    rank's shard or the resampled values hold NaN, or where V2's top-k / top-p cut is
    not certain for more rows than can be made whole (every rank alike).
    invalid_drafts: the rows whose draft V2 verifies as -1 (a grammar's, up to vLLM
    0.33). Every rank calls it together."""
    import numpy as np  # not at import: commfold imports without numpy
    from vllm.triton_utils import triton
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled

    sampler = rejection_sampler.sampler
    states = sampler.sampling_states
    comm = communicator(head.comm)
    rank, world = comm.rank(), comm.world_size()
    draft, pos = gather_draft_sampled(
        input_batch.input_ids, input_batch.positions, input_batch.logits_indices,
        input_batch.expanded_idx_mapping, input_batch.expanded_local_pos,
        sampler.req_states.prefill_len.gpu)
    mapping, local_pos = input_batch.expanded_idx_mapping, input_batch.expanded_local_pos
    idx_np = input_batch.idx_mapping_np
    processing = bool(np.any(sampler.needs_logits_processing[idx_np]))
    itemsize = shard.element_size()  # the raw logits' (vLLM's gather)
    start = rank * head.shard
    n_real = max(0, min(head.shard, head.vocab - start))
    if processing:  # V2's processing on this rank's columns, the draft tokens as V2's
        buf = torch.empty(shard.shape[0], head.shard + 1, dtype=torch.float32,
                          device=shard.device)  # one spare column for min_p
        buf[:, :head.shard].copy_(shard)
        if not sampling_params.process(sampler, buf, n_real, start, input_batch, comm, draft):
            return sampled_pick.NAN
        shard = buf[:, :head.shard]
    # this rank's real columns (no padding: V2's rows are cut to the vocab)
    target = shard[:, :n_real]
    if processing and sampling_params.truncates(states, idx_np):
        why = _cut(comm, head, target, states, input_batch, start, itemsize)
        if why is not None:  # from gathered values: alike on every rank
            return why
    real_draft = draft  # the tokens drafted (a grammar's invalid ones too)
    if invalid_drafts is not None:  # V2 verifies these drafts as -1 (rejected)
        draft = draft.masked_fill(invalid_drafts, -1)
    rows, device = target.shape[0], target.device
    vocab = head.vocab  # V2's target_logits width
    draft_logits = verify_kernels.values(draft_logits)  # 0.34: the cache's values
    if draft_logits is not None:  # rows commfold's drafter filled in part: whole if needed
        draft_cache.prepare_verify(draft_logits, head.shard,
                                   min(head.vocab, draft_logits.shape[-1]), real_draft,
                                   input_batch)
    eff = vocab if draft_logits is None else min(vocab, draft_logits.shape[-1])
    lay = Layout(head.shard, eff, world)
    lo, hi = lay.span(rank)
    steps = rejection_sampler.num_speculative_steps
    temp, seeds = states.temperature.gpu, states.seeds.gpu
    has_draft = draft_logits is not None

    whole = whole_blocks(comm, lay, shard)  # processed columns where V2 processes
    nan_here = bool(target[:, :max(0, min(head.shard, eff - start))].isnan().any())
    nb = lay.first[rank + 1] - lay.first[rank]
    f32 = dict(dtype=torch.float32, device=device)
    t_arg = torch.zeros(rows, nb, dtype=torch.int64, device=device)
    stats = [torch.zeros(rows, nb, **f32) for _ in range(4)]  # target, draft max / sum
    if nb and rows:
        own_draft = draft_logits[:, :, lo:] if has_draft else None
        t_max, t_sum, d_max, d_sum = stats
        # V2's logits: the gathered rows cut to the vocab, or its float32 copy
        local, size = like_v2(whole, vocab if processing else head.shard * world,
                              hi == eff, eff)
        verify_kernels.stats((rows, nb), t_arg, t_max, t_sum, d_max, d_sum, local, size,
                             own_draft, mapping, local_pos, temp, steps)
        t_arg += lo  # the kernel's ids count from the buffer's first column

    # the target logit at each row's next draft token, from the rank holding it
    nxt = torch.cat([draft[1:], draft.new_full((1,), -1)]).to(torch.int64)
    held = (nxt >= start) & (nxt < min(start + head.shard, vocab))
    at_draft = torch.zeros(rows, **f32)
    if bool(held.any()):
        sel = held.nonzero()[:, 0]
        at_draft[sel] = target[sel, nxt[sel] - start].float()

    # one exchange (int32 words): per-block stats, the draft-token logit, a NaN flag
    floats = stats if has_draft else stats[:2]
    top = max(lay.first[q + 1] - lay.first[q] for q in range(world))
    k = len(floats)
    payload = torch.zeros(rows, (k + 2) * top + 2, dtype=torch.int32, device=device)
    for i, x in enumerate(floats):
        payload[:, i * top:i * top + nb] = x.view(torch.int32)
    payload[:, k * top:k * top + 2 * nb] = t_arg.view(torch.int32)
    payload[:, -2] = at_draft.view(torch.int32)
    payload[:, -1] = int(nan_here)
    got = comm.all_gather(payload).view(world, rows, -1)
    if bool((got[:, :, -1] & 1).any()):
        return sampled_pick.NAN
    blocks = lay.blocks
    full = [torch.zeros(rows, blocks, **f32) for _ in range(4)]
    argmax = torch.zeros(rows, blocks, dtype=torch.int64, device=device)
    for q in range(world):
        b0, b1 = lay.first[q], lay.first[q + 1]
        for i in range(k):
            full[i][:, b0:b1] = got[q, :, i * top:i * top + b1 - b0].contiguous().view(
                torch.float32)
        argmax[:, b0:b1] = got[q, :, k * top:k * top + 2 * (b1 - b0)].contiguous().view(
            torch.int64)
    owner = (nxt.clamp(min=0) // head.shard).clamp(max=world - 1)
    values = got[:, :, -2].contiguous().view(torch.float32)  # [world, rows]
    at_draft = values.gather(0, owner[None].to(device)).squeeze(0)

    # V2's rejection kernel on what it reads: the draft-token entries and the blocks
    t_buf = torch.empty(rows, vocab, **f32)
    ok = nxt >= 0
    t_buf[ok.nonzero()[:, 0], nxt[ok]] = at_draft[ok]
    cu, idx_mapping = input_batch.cu_num_logits, input_batch.idx_mapping
    reqs = cu.shape[0] - 1
    padded = triton.next_power_of_2(blocks)
    sampled = draft.new_empty(reqs, steps + 1, dtype=torch.int64)
    num_sampled = sampled.new_empty(reqs, dtype=torch.int32)
    t_lse, d_lse = torch.empty(reqs, **f32), torch.empty(reqs, **f32)
    t_max_a, t_sum_a, d_max_a, d_sum_a = full
    verify_kernels.rejection(rejection_sampler, sampled, num_sampled, t_lse, d_lse, t_buf,
                             argmax, t_max_a, t_sum_a, draft, draft_logits, d_max_a, d_sum_a,
                             cu, idx_mapping, temp, seeds, pos, blocks, padded)

    # V2's resample kernel over the full width, this rank's columns, -inf elsewhere
    again = (cu[:-1].to(torch.int64) + num_sampled.to(torch.int64)).to(device)
    t_buf[again] = float("-inf")
    n_cols = max(0, min(start + head.shard, eff) - start)
    if n_cols:
        t_buf[again, start:start + n_cols] = target[again, :n_cols].float()
    use_fp64 = bool(sampler.use_fp64_gumbel)
    r_blocks = -(-eff // RESAMPLE_BLOCK)
    # rows the kernel skips (greedy, rejected: the argmax already stored) keep -inf
    r_idx = torch.zeros(reqs, r_blocks, dtype=torch.int64, device=device)
    r_val = torch.full((reqs, r_blocks), float("-inf"), device=device,
                       dtype=torch.float64 if use_fp64 else torch.float32)
    verify_kernels.resample(sampler, idx_np, r_idx, r_val, t_buf, t_lse, draft_logits,
                            d_lse, num_sampled, cu, mapping, draft, temp, seeds, pos, eff,
                            use_fp64)
    best = r_val.argmax(dim=-1, keepdim=True)  # the first block holding the maximum
    value = r_val.gather(-1, best).squeeze(-1)
    value = value.masked_fill(r_val.isnan().any(-1), float("nan"))
    token = r_idx.gather(-1, best).squeeze(-1)

    # one (value bits, token) pair per request per rank; V2's insert picks the first
    pair = torch.stack([value_bits(value), token], dim=-1)
    pairs = comm.all_gather(pair).view(world, reqs, 2)
    vals = bits_value(pairs[..., 0], value.dtype).t().contiguous()
    if bool(vals.isnan().any()):
        return sampled_pick.NAN
    toks = pairs[..., 1].t().contiguous()
    verify_kernels.insert(sampled, num_sampled, toks, vals, cu, mapping, temp,
                          triton.next_power_of_2(world))
    return Verified(sampled, num_sampled, shard)


def like_v2(whole: torch.Tensor, stride: int, last: bool, eff: int):
    """(buffer, vocab_size) for V2's stats kernel on this rank's blocks `whole`
    [rows, width] as its launch on the full logits is compiled: Triton specializes a
    kernel on whether its pointers and integer arguments divide by 16, and that can
    change how a block's elements are spread over threads - the order of its sum. So
    the buffer rows have V2's stride (blocks start at multiples of 8192: aligned as
    V2's) and vocab_size V2's divisibility: `eff`'s. This rank's width ends at eff
    (`last`: the same residue) or at a multiple of 8192; there, where eff does not
    divide by 16, one column more - in the block past this rank's, never launched."""
    rows, width = whole.shape
    buf = whole.new_empty(rows, max(stride, width))
    buf[:, :width] = whole
    return buf, width if last or eff % 16 == 0 else width + 1
