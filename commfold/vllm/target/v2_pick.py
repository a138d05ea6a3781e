"""Model Runner V2's sampler outputs from this rank's logits shard: what both of
commfold's V2 target-pick hook sets (commfold.vllm.target.target_pick_v2 up to vLLM 0.33,
commfold.vllm.target.target_pick_state from 0.34) return in place of V2's Sampler /
RejectionSampler for a step commfold.vllm.target.decision.decide_v2 qualifies.

- ``greedy``: commfold.ops.local_argmax over the shard (one (value, index) pair per
  row per rank): the first maximum, as V2's argmax (Gumbel kernel at temperature 0);
- ``verify``: the target's argmax at every row, then V2's strict greedy accept rule
  (a draft is accepted while it equals the target's argmax and is not a
  placeholder; the first rejected position and the bonus position take the target's
  argmax), drafts read by V2's own ``gather_draft_sampled``;
- ``logprobs``: greedy with V2's ``compute_topk_scores`` from two small all-gathers
  (commfold.ops.local_logprobs.local_topk_scores); rows it cannot do exactly are
  gathered and scored by V2's own function;
- ``sample`` / ``sample_logprobs``: a step with sampled requests or processed logits,
  drawn as V2's Gumbel kernel draws it (commfold.vllm.sample.sampled_pick), logprobs of the
  drawn token scored as above from the raw or the processed shard;
- ``verify_sampled``: a spec-decode step with sampled requests, V2's probabilistic
  ("standard") rejection sampling on the shards (commfold.vllm.spec_decode.shard_verify).

Structured output: the hooks mask the shard with the step's grammar bitmask first
(commfold.vllm.sample.shard_grammar), so every mode above reads V2's masked logits.

NaN: a step whose gathered maxima hold NaN (the same on every rank) is gathered and
given to V2's own samplers, so its token is V2's whatever rule V2's kernels apply to
NaN (``vllm_samplers``).
"""
from __future__ import annotations

import weakref

from commfold.shard import accept
from commfold.vllm.sample import sampled_pick, sampling_params, shard_grammar
from commfold.vllm.spec_decode import shard_verify
from commfold.vllm.observe import step_log
from commfold.vllm.target.decision import V2Step, decide_v2, verify_method
from commfold.vllm.target.logits_head import LogitsHead

_REJECT = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
SAMPLED = ("sample", "sample_logprobs")  # commfold.vllm.sample.sampled_pick's modes
VERIFY_SAMPLED = "verify_sampled"  # commfold.vllm.spec_decode.shard_verify's
# what the pick's exactness rests on inside V2's kernels and helpers, whichever hook
# set hands it the step (hook_points: (module:Attr.path, text))
PICK_POINTS = (
    ("vllm.v1.worker.gpu.sample.states:SamplingStates.add_request",
     "return temperature != 0.0 and ("),
    ("vllm.v1.worker.gpu.sample.logprob:compute_topk_scores",
     "topk_indices = torch.topk(logits, num_logprobs, dim=-1).indices"),
    ("vllm.v1.worker.gpu.sample.logprob:_topk_log_softmax_kernel",
     "o = logits - max_val - lse"),
    ("vllm.v1.worker.gpu.sample.logprob:_ranks_kernel",
     "n += tl.sum((logits >= x).to(tl.int32))"),
    (f"{_REJECT}:RejectionSampler.__call__", "draft_sampled, pos = gather_draft_sampled("),
    ("vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils:",  # in _rejection_kernel
     "accepted = target_argmax == draft_sampled"),
)

# model -> the head a V2 hook found for it (prompt logprobs are computed with the
# model's compute_logits, outside the sampler the hooks see)
_heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def note_head(model, head: LogitsHead | None) -> None:
    """Remember the head a hook found for `model` (None: none, the pick is off)."""
    try:
        _heads[model] = head
    except TypeError:  # not weak-referenceable: nothing remembered
        pass


def head_of(model) -> LogitsHead | None:
    try:
        return _heads.get(model)
    except TypeError:
        return None


def step_of(sampler, input_batch, vocab: int = 0) -> V2Step:
    """What V2's Sampler holds about the step's requests (V2's own arrays)."""
    idx = input_batch.idx_mapping_np
    idx = idx[idx >= 0]
    states = sampler.sampling_states
    dims = sampler.get_logprobs_dims(idx)
    return V2Step(
        temperatures=tuple(float(t) for t in states.temperature.np[idx]),
        top_k_or_p=sampling_params.truncates(states, idx),
        needs_processing=bool(sampler.needs_logits_processing[idx].any()),
        logprobs=dims is not None, num_logprobs=dims[0] if dims else 0,
        logprob_token_ids=bool(dims and dims[1]), logprobs_mode=str(sampler.logprobs_mode),
        vocab=vocab, sampler=type(sampler).__name__,
        trace_replay=getattr(sampler, "trace_replay_state", None) is not None,
        sampling_mask=bool(getattr(sampler, "return_sampling_mask", False)),
        nan_check=bool(getattr(sampler, "compute_nans", False)),
        processing=processing_of(sampler, idx),
        fused_sampler=fused_sampler(sampler, idx, dims is not None),
        fused_on_gumbel=sampled_pick.fused_on_gumbel(),
        split_top_p=split_top_p(states, idx, len(input_batch.expanded_idx_mapping)))


def fused_sampler(sampler, idx, logprobs: bool) -> bool:
    """Whether V2's Sampler.sample would draw the step with its fused top-k / top-p
    sampler (FlashInfer's or XPU's) rather than its Gumbel kernel: V2's own test."""
    if not (getattr(sampler, "use_flashinfer", False)
            or getattr(sampler, "use_xpu_sampler", False)):
        return False
    states = sampler.sampling_states
    processed = logprobs and str(sampler.logprobs_mode).startswith("processed")
    return sampling_params.truncates(states, idx) and not (processed or states.any_greedy(idx)
                              or states.any_explicit_seed(idx))


def split_top_p(states, idx, rows: int) -> bool:
    """Whether vLLM's top-k / top-p kernel sends a top-p-only row of the step through
    its split top-p kernels (CUDA-like platforms, batches of up to 64 rows)."""
    only_p = (states.top_p.np[idx] != 1.0) & (states.top_k.np[idx] == states.vocab_size)
    if not only_p.any():
        return False
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops import topk_topp_triton

    return bool(current_platform.is_cuda_alike()) and \
        rows <= getattr(topk_topp_triton, "_SPLIT_MAX_BATCH", 64)


_PROCESSORS = {"PenaltiesState": "penalties", "LogitBiasState": "logit_bias",
               "BadWordsState": "bad_words"}


def processing_of(sampler, idx) -> tuple[str, ...]:
    """The kinds of logits processing V2's Sampler would run for the requests `idx`
    (its per-request arrays; commfold.vllm.target.decision.SAMPLED_LOCAL names those done on
    a shard). A custom processor counts whenever a request needs processing (V2 runs
    every processor then)."""
    if not sampler.needs_logits_processing[idx].any():
        return ()
    states = sampler.sampling_states
    temps = states.temperature.np[idx]
    kinds = []
    for p in sampler.logits_processors:
        kind = _PROCESSORS.get(type(p).__name__, "custom")
        if kind not in kinds and _active(kind, p, idx):
            kinds.append(kind)
    budget = getattr(sampler, "thinking_budget_state", None)
    if budget is not None and getattr(budget, "enabled", True) and \
            budget.use_thinking_budget[idx].any():
        kinds.append("thinking_budget")
    if ((temps != 0.0) & (temps != 1.0)).any():
        kinds.append("temperature")
    if (states.min_p.np[idx] != 0.0).any():
        kinds.append("min_p")
    if (states.top_k.np[idx] != states.vocab_size).any():
        kinds.append("top_k")
    if (states.top_p.np[idx] != 1.0).any():
        kinds.append("top_p")
    return tuple(kinds)


def _active(kind: str, processor, idx) -> bool:
    """Whether V2's built-in processor acts on a request of `idx` (a custom one: yes)."""
    if kind == "penalties":
        return bool(processor.use_penalty[idx].any())
    if kind == "logit_bias":
        return bool(processor.use_logit_bias[idx].any())
    if kind == "bad_words":
        return bool((processor.num_bad_words.np[idx] > 0).any())
    return True


def decide_step(sampler, rejection_sampler, spec_config, input_batch, structured: bool,
                vocab: int = 0) -> tuple[str | None, str]:
    """decide_v2 for one step of a V2 runner with these samplers: the same on every
    rank (the samplers' request arrays, the batch's layout, the engine's config)."""
    if sampler is None or input_batch.num_reqs == 0:
        return None, "no sampler or no requests on this rank"
    spec = input_batch.num_draft_tokens > 0 and rejection_sampler is not None
    verify = verify_method(spec_config, rejection_sampler) if spec else None
    if spec and type(rejection_sampler).__name__ != "RejectionSampler":
        return None, f"rejection sampler {type(rejection_sampler).__name__}"
    mode, why = decide_v2(step_of(sampler, input_batch, vocab), spec=spec,
                          structured=structured, verify=verify)
    if mode in SAMPLED and (moved := sampled_pick.refusal()) is not None:
        return None, moved
    if mode is not None and structured and (moved := shard_grammar.refusal()) is not None:
        return None, moved
    if mode == VERIFY_SAMPLED and (moved := shard_verify.refusal(rejection_sampler)):
        return None, moved
    return mode, why


def pick(sampler, rejection_sampler, head: LogitsHead, shard, input_batch, mode: str,
         vllm_samplers, draft_logits=None, invalid_drafts=None):
    """V2's SamplerOutput for the step, from this rank's logits shard. vllm_samplers
    (full logits -> SamplerOutput) runs V2's own samplers on a step given back;
    draft_logits: the drafter's cached logits V2's RejectionSampler gets (up to vLLM
    0.33 a tensor, from 0.34 a DraftLogitsCache; None without); invalid_drafts: the
    rows whose draft a grammar did not constrain (up to 0.33; V2 verifies them as -1)."""
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    from commfold.ops.local_argmax import local_argmax

    scores = None
    logits_mode = sampler.logprobs_mode in ("raw_logits", "processed_logits")
    idx = input_batch.idx_mapping_np
    scored = shard  # the logits logprobs are scored from
    if mode == VERIFY_SAMPLED:
        if (why := shard_verify.draft_refusal(draft_logits)) is not None:
            return _given_back(head, shard, vllm_samplers, why)  # engine config: all ranks
        verified = shard_verify.verify(rejection_sampler, head, shard, input_batch,
                                       draft_logits, invalid_drafts)
        if isinstance(verified, str):  # from gathered values: the same on every rank
            return _given_back(head, shard, vllm_samplers, verified)
        sampled, num_sampled, processed = verified
        if sampler.logprobs_mode.startswith("processed"):
            scored = processed
    elif mode in SAMPLED:
        drawn = sampled_pick.draw(sampler, head, shard, input_batch)
        if isinstance(drawn, str):  # from gathered values: the same on every rank
            return _given_back(head, shard, vllm_samplers, drawn)
        tokens = drawn.tokens
        if mode == "sample_logprobs":
            if sampler.logprobs_mode.startswith("processed"):
                scored = drawn.processed.contiguous()
            k = sampler.get_logprobs_dims(idx[idx >= 0])[0]
            scores = logprobs_scores(head, scored, k, logits_mode, tokens)
    else:
        if mode == "logprobs":
            k = sampler.get_logprobs_dims(idx[idx >= 0])[0]
            scores = logprobs_scores(head, shard, k, logits_mode)
            values, tokens = scores.maxima, scores.tokens
        else:
            values, tokens = local_argmax(shard, head.vocab, head.comm)
        if values.isnan().any():  # gathered maxima: the same on every rank
            return _given_back(head, shard, vllm_samplers, sampled_pick.NAN)
    prefill_len = sampler.req_states.prefill_len.gpu
    if mode == "verify":
        sampled, num_sampled = verify(rejection_sampler, input_batch, tokens, prefill_len,
                                      invalid_drafts)
    elif mode != VERIFY_SAMPLED:
        sampled = tokens.view(-1, 1)
        num_sampled = input_batch.seq_lens.new_ones(input_batch.num_reqs)
    generated = None  # under spec decoding: each request's logits rows, as V2 gives them
    if mode in ("verify", VERIFY_SAMPLED) and (dims := sampler.get_logprobs_dims(idx)):
        flat = accept.verified_tokens(sampled, num_sampled, input_batch.cu_num_logits_np)
        scores = logprobs_scores(head, scored, dims[0], logits_mode, flat)
        if flat.shape[0] != input_batch.num_reqs:
            generated = input_batch.cu_num_logits_np.tolist()
    num_sampled, num_rejected = get_num_sampled_and_rejected(
        num_sampled, input_batch.seq_lens, input_batch.cu_num_logits,
        input_batch.idx_mapping, prefill_len)
    logprobs = None
    if scores is not None:
        from vllm.v1.outputs import LogprobsTensors

        logprobs = LogprobsTensors(*tensors(head, scored, scores, logits_mode),
                                   cu_num_generated_tokens=generated)
    return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs,
                         num_nans=None, num_sampled=num_sampled, num_rejected=num_rejected)


def _given_back(head: LogitsHead, shard, vllm_samplers, why: str):
    """The step gathered and sampled by V2's own samplers, the reason in the step log."""
    step_log.note("target_pick", f"vLLM ({why})")
    return vllm_samplers(head.gather(shard))


def logprobs_scores(head: LogitsHead, shard, k: int, logits_mode: bool, targets=None):
    """commfold.ops.local_logprobs.local_topk_scores with k top logprobs (V2 scores
    every row with the batch's most, as here) of the greedy token or the targets."""
    from commfold.ops.local_logprobs import local_topk_scores

    return local_topk_scores(shard, head.vocab, head.comm, k, logits_mode, targets=targets)


def tensors(head: LogitsHead, shard, scores, logits_mode: bool):
    """(token ids, scores, ranks) as V2's compute_topk_scores gives them, from
    local_topk_scores; rows it marks whole are gathered (every rank the same rows) and
    scored by V2's own compute_topk_scores."""
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    ids, values, ranks = scores.ids, scores.scores, scores.ranks
    if bool(scores.whole.any()):
        sel = scores.whole.nonzero()[:, 0]
        full = head.gather(shard[sel].contiguous())
        theirs = compute_topk_scores(full, ids.shape[1] - 1, scores.tokens[sel],
                                     logits_mode=logits_mode)
        ids, values, ranks = ids.clone(), values.clone(), ranks.clone()
        ids[sel] = theirs.logprob_token_ids.long()
        values[sel] = theirs.logprobs.float()
        ranks[sel] = theirs.selected_token_ranks.long()
    return ids, values, ranks


def verify(rejection_sampler, input_batch, argmax, prefill_len, invalid_drafts=None):
    """V2's strict greedy verification from the target's argmax per logits row:
    (sampled [reqs, steps + 1], num_sampled [reqs] int32); invalid_drafts: rows whose
    draft V2 sets to -1 (rejected) before verifying."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled

    draft, _ = gather_draft_sampled(
        input_batch.input_ids, input_batch.positions, input_batch.logits_indices,
        input_batch.expanded_idx_mapping, input_batch.expanded_local_pos, prefill_len)
    if invalid_drafts is not None:
        draft = draft.masked_fill(invalid_drafts, -1)
    return accept.greedy(draft, argmax, input_batch.cu_num_logits_np, input_batch.num_reqs,
                         rejection_sampler.num_speculative_steps)
