"""Whether commfold's local pick may replace vLLM's for one engine step: a pure
function of the step's sampling parameters and the engine's speculative config, the
same on every rank (one rank picking locally and another gathering would be a
collective mismatch). ``decide`` reads V1's SamplingMetadata, ``decide_v2`` what
Model Runner V2's Sampler holds (``V2Step``); both share the verification rule below.
vLLM is imported only to recognize V1's built-in logits processors.

Spec-decode verification is replaced only where it is strict greedy: every request
greedy and vLLM's ``rejection_sample_method`` "standard" (the target's argmax must
equal the draft token). Every other method vLLM defines - "synthetic" (acceptance
at configured rates), "block" (block verification), "fly" (FLy's lossy,
entropy-gated acceptance, from vLLM 0.33), adaptive verification - and any method
commfold does not know run vLLM's code. On Model Runner V2 a "standard" step with
sampled requests is verified on the shards as V2's RejectionSampler verifies it
("verify_sampled", commfold.vllm.spec_decode.shard_verify) when its processing is done on a shard
(SPEC_LOCAL: all but a custom processor; top-k / top-p where the cut is proved exact); V2's logprobs
of the verified tokens (greedy and sampled steps) are scored on the shards as in
steps without drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

# the byte counts the batch-sharded comparison weighs (commfold.cost's
# BATCH_SHARDED_PICK rule), importable here with the rest of the step's decision
from commfold.cost import all_to_all_bytes, pick_bytes  # noqa: F401

MAX_LOGPROBS = 20
LOGPROB_MODES = ("raw_logprobs", "processed_logprobs")
# V2 scores its top logits as logprobs or as the logits themselves (exact locally); a
# step commfold takes has no processing, so processed equals raw
V2_LOGPROB_MODES = (*LOGPROB_MODES, "raw_logits", "processed_logits")

# rejection_sample_method values whose greedy verification is commfold's pick
STRICT_GREEDY = ("standard",)
# the other verification methods vLLM 0.32 to 0.34 define, and why they stay vLLM's
LEFT_TO_VLLM = {
    "synthetic": "accepts drafts at configured rates, not by the target's argmax",
    "block": "block verification judges the drafts jointly",
    "fly": "FLy's lossy acceptance reads entropy of the full-vocab logits",
    "adaptive": "adaptive verification sizes the verify budget from draft confidence",
}


def verify_method(spec_config, rejection_sampler=None) -> str:
    """The verification method of the engine's spec-decode steps: the speculative
    config's ``rejection_sample_method`` ("adaptive" when adaptive verification is on),
    overruled by what the runner's rejection sampler was built to do (V1's
    ``synthetic_mode`` / ``use_fly``, V2's ``synthetic_conditional_rates`` /
    ``use_block_verification`` / ``fly_window_size``). A config without the field
    reads as "unknown: ...". Every input is engine configuration: rank-consistent."""
    if spec_config is None:
        return "unknown: no speculative config"
    if getattr(spec_config, "enable_adaptive_verification", False):
        return "adaptive"
    method = getattr(spec_config, "rejection_sample_method", None)
    if not isinstance(method, str):
        return "unknown: no rejection_sample_method"
    built = _sampler_method(rejection_sampler)
    return built if built is not None and built != method else method


def _sampler_method(sampler) -> str | None:
    """The non-standard method a vLLM RejectionSampler (V1 or V2) was built for."""
    if sampler is None:
        return None
    if getattr(sampler, "enable_adaptive_verification", False):
        return "adaptive"
    if getattr(sampler, "synthetic_mode", False) or \
            getattr(sampler, "synthetic_conditional_rates", None) is not None:
        return "synthetic"
    if getattr(sampler, "use_block_verification", False):
        return "block"
    if getattr(sampler, "use_fly", False) or getattr(sampler, "fly_window_size", None):
        return "fly"  # V1 leaves fly_window_size None, V2 0, when FLy is off
    return None


def verify_refusal(method: str | None) -> str | None:
    """Why greedy verification under `method` stays vLLM's; None when it is strict
    greedy (commfold may replace it)."""
    if method in STRICT_GREEDY:
        return None
    if method in LEFT_TO_VLLM:
        return f"verification method {method}: {LEFT_TO_VLLM[method]}"
    return f"verification method {method or 'unknown'} (commfold knows {STRICT_GREEDY[0]})"


def step_refusal(structured: bool, nan_check: bool, spec: bool,
                 verify: str | None) -> str | None:
    """Why a step stays vLLM's whatever its requests ask, on either runner: structured
    output, vLLM counting NaNs over the whole row, a verification method other than
    strict greedy; None when none applies."""
    if structured:
        return "structured output"
    if nan_check:
        return "VLLM_COMPUTE_NANS_IN_LOGITS"
    return verify_refusal(verify) if spec else None


def decide(md, *, spec: bool, structured: bool, logprobs_mode: str, vocab: int,
           nan_check: bool = False, verify: str | None = None) -> tuple[str | None, str]:
    """(mode, reason): mode "greedy" / "verify" / "logprobs", or None with why not.
    md is vLLM's SamplingMetadata of the step; nan_check: VLLM_COMPUTE_NANS_IN_LOGITS
    (vLLM counts NaNs over the whole row); verify: the engine's verification method
    (verify_method), read only under spec decoding - None there means unknown."""
    refusal = step_refusal(structured, nan_check, spec, verify)
    if refusal is not None:
        return None, refusal
    if not md.all_greedy:
        return None, "sampling (temperature > 0)"
    if not md.no_penalties:
        return None, "penalties"
    if md.bad_words_token_ids:
        return None, "bad words"
    if md.allowed_token_ids_mask is not None:
        return None, "allowed token ids"
    active = active_processors(md)
    if active:
        return None, "logits processors: " + ", ".join(active)
    holder = md.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return None, "thinking budget"
    if md.logprob_token_ids:
        return None, "logprob_token_ids"
    k = md.max_num_logprobs
    if k is None:
        return ("verify" if spec else "greedy"), "all greedy"
    return logprobs_mode_ok(k, logprobs_mode, vocab, spec)


def logprobs_mode_ok(k: int, logprobs_mode: str, vocab: int, spec: bool = False,
                     modes: tuple[str, ...] = LOGPROB_MODES):
    if spec:
        return None, "logprobs under spec decoding"
    if not 0 <= k <= MAX_LOGPROBS:
        return None, f"logprobs={k} (local up to {MAX_LOGPROBS})"
    if 64 * k > vocab:  # torch.topk takes nth_element there: order not reproducible
        return None, f"logprobs={k} with vocab {vocab} < 64 k"
    if logprobs_mode not in modes:
        return None, f"logprobs_mode {logprobs_mode}"
    return "logprobs", f"greedy, logprobs={k}"


def active_processors(md) -> list[str]:
    """Logits processors that would change greedy logits in this batch. vLLM's
    min_tokens and logit_bias processors are always loaded and act only while a
    request uses them; any other (a plugin, a per-request adapter) counts as active."""
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    active = []
    for p in md.logitsprocs.non_argmax_invariant:
        if isinstance(p, MinTokensLogitsProcessor):
            if p.min_toks:
                active.append("min_tokens")
        elif isinstance(p, LogitBiasLogitsProcessor):
            if p.biases:
                active.append("logit_bias")
        else:
            active.append(type(p).__name__)
    return active


# --- Model Runner V2 ---------------------------------------------------------------

@dataclass(frozen=True)
class V2Step:
    """What Model Runner V2's Sampler holds about one step's requests (its per-request
    state arrays, filled from the scheduler's requests: the same on every rank)."""
    temperatures: tuple[float, ...]
    top_k_or_p: bool  # a request with top-k or top-p (V2 masks before its argmax)
    needs_processing: bool  # V2's needs_logits_processing for a request of the step
    logprobs: bool  # a request wants logprobs or logprob_token_ids
    sampler: str = "Sampler"  # the sampler's class: only V2's plain Sampler is known
    trace_replay: bool = False
    sampling_mask: bool = False  # return_sampling_mask
    nan_check: bool = False  # VLLM_COMPUTE_NANS_IN_LOGITS
    num_logprobs: int = 0  # the step's most top logprobs a request asks for
    logprob_token_ids: bool = False  # a request names its own logprob token ids
    logprobs_mode: str = "raw_logprobs"  # the Sampler's
    vocab: int = 0  # the model's vocab
    # the logits processing the step's requests ask for (``processing_of``): kinds
    # in SAMPLED_LOCAL run on the shard, every other keeps the step vLLM's
    processing: tuple[str, ...] = ()
    # V2 would sample the step with a fused top-k / top-p sampler (FlashInfer's, XPU's)
    fused_sampler: bool = False
    fused_on_gumbel: bool = False  # the user's option: take such steps on the Gumbel path
    # a top-p-only row on CUDA in a batch V2 sends through its split top-p kernels
    split_top_p: bool = False


# V2's processing of a sampled step that commfold.vllm.sample.sampled_pick does on a shard
SAMPLED_LOCAL = ("temperature", "min_p", "penalties", "logit_bias", "bad_words",
                 "thinking_budget", "top_k", "top_p")
# the rest, and why each stays vLLM's
SAMPLED_LEFT = {
    "custom": "a custom logits processor (it may read the whole row)",
}


def decide_v2(step: V2Step, *, spec: bool, structured: bool,
              verify: str | None = None) -> tuple[str | None, str]:
    """(mode, reason) for a Model Runner V2 step: "greedy" / "verify", or None with
    why not. The same rules as ``decide`` (V1): strict greedy only, nothing needing
    the whole row; "logprobs" for greedy steps that want top logprobs (V2's
    compute_topk_scores: commfold.ops.local_logprobs.local_topk_scores). A step with
    a sampled request or processed logits (greedy ones too: V2 draws every row of a
    step with one Gumbel kernel) is "sample" / "sample_logprobs" - the whole step,
    commfold.vllm.sample.sampled_pick - when all its processing is in SAMPLED_LOCAL and it is
    no spec-decode step; under spec decoding "verify_sampled" (``verify_sampled``).
    Structured output (`structured`, read by no rule here): its bitmask applied on
    the shards first (commfold.vllm.sample.shard_grammar), under spec decoding too - V2
    verifies the masked rows, a grammar's invalid drafts as -1."""
    refusal = step_refusal(False, step.nan_check, spec, verify)
    if refusal is not None:
        return None, refusal
    if step.sampler != "Sampler":
        return None, f"sampler {step.sampler} (commfold knows V2's Sampler)"
    if not step.temperatures:
        return None, "no requests"
    if step.top_k_or_p and (why := truncation_refusal(step, spec)) is not None:
        return None, why
    if step.trace_replay:
        return None, "trace replay"
    if step.sampling_mask:
        return None, "return_sampling_mask"
    if step.needs_processing and not step.processing:
        return None, ("logits processing (penalties, logit bias, min tokens, bad words, "
                      "a thinking budget or a custom processor)")
    sampled = step.needs_processing or any(t != 0.0 for t in step.temperatures)
    if sampled and spec:
        return verify_sampled(step)
    if sampled:
        left = [SAMPLED_LEFT.get(p, p) for p in step.processing if p not in SAMPLED_LOCAL]
        if left:
            return None, "logits processing: " + ", ".join(left)
        return sampled_logprobs(step)
    if step.logprobs:
        if step.logprob_token_ids:
            return None, "logprob_token_ids"
        mode, why = logprobs_mode_ok(step.num_logprobs, step.logprobs_mode, step.vocab,
                                     False, V2_LOGPROB_MODES)
        # under spec decoding V2 scores each verified row's token (commfold.vllm.target.v2_pick)
        return (mode and ("verify" if spec else mode)), why
    return ("verify" if spec else "greedy"), "all greedy"


FUSED_OPTION = "COMMFOLD_FUSED_SAMPLER_STEPS"  # =gumbel: take fused-sampler steps (graph_passes)


def truncation_refusal(step: V2Step, spec: bool = False) -> str | None:
    """Why a step with top-k / top-p stays V2's (commfold.shard.bounds takes
    the rest, by bounds of the kernel's cut); None when it may be taken. spec: V2's
    verification cuts the target logits with the kernel itself, never a fused
    sampler."""
    if step.fused_sampler and not step.fused_on_gumbel and not spec:
        return ("top-k / top-p: V2 samples this step with its fused sampler (FlashInfer "
                f"or XPU), which draws otherwise; {FUSED_OPTION}=gumbel takes it on "
                "V2's Gumbel path: equal in distribution, not in tokens")
    if step.split_top_p:
        return "top-p: CUDA's split top-p kernels (their cut is not bounded here)"
    if not step.needs_processing:
        return "top-k / top-p on unprocessed logits (greedy requests only)"
    if step.logprobs and step.logprobs_mode.startswith("processed"):
        return "processed logprobs after top-k / top-p (they read the cut's exact edge)"
    return None


# V2's processing of a sampled spec-decode step that
# commfold.vllm.spec_decode.shard_verify does on a shard
SPEC_LOCAL = ("temperature", "min_p", "penalties", "logit_bias", "bad_words",
              "thinking_budget", "top_k", "top_p")


def verify_sampled(step: V2Step) -> tuple[str | None, str]:
    """(mode, reason) for a spec-decode step with a sampled request (verification
    already known "standard"): "verify_sampled" - V2's rejection sampling of the whole
    step on the shards (commfold.vllm.spec_decode.shard_verify) - when its processing is in
    SPEC_LOCAL and its logprobs (of each verified row's token) can be scored locally."""
    left = [SAMPLED_LEFT.get(p, p) for p in step.processing if p not in SPEC_LOCAL]
    if left:
        return None, "sampled verification with logits processing: " + ", ".join(left)
    mode, why = sampled_logprobs(step)
    return (mode and "verify_sampled"), why


def sampled_logprobs(step: V2Step) -> tuple[str | None, str]:
    """(mode, reason) for a sampled step commfold can draw: with or without logprobs
    (of the sampled token, top k scored as in greedy steps)."""
    what = "sampled: " + ", ".join(step.processing or ("no processing",))
    if not step.logprobs:
        return "sample", what
    if step.logprob_token_ids:
        return None, "logprob_token_ids"
    mode, why = logprobs_mode_ok(step.num_logprobs, step.logprobs_mode, step.vocab, False,
                                 V2_LOGPROB_MODES)
    return ("sample_logprobs", f"{what}, logprobs={step.num_logprobs}") if mode else \
        (None, why)


def decide_v2_prompt(k: int, logprobs_mode: str, vocab: int) -> tuple[str | None, str]:
    """(mode, reason) for Model Runner V2's prompt logprobs of a step: "logprobs" when
    the step's most prompt logprobs k can be scored locally (V2 scores prompt positions
    from the raw logits, whatever the requests' sampling parameters), else None."""
    if k == -1:
        return None, "prompt_logprobs=-1 (the whole vocab)"
    mode, why = logprobs_mode_ok(k, logprobs_mode, vocab, False, V2_LOGPROB_MODES)
    return mode, why.replace("logprobs=", "prompt_logprobs=").replace("greedy, ", "")
