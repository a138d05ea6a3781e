"""The target model's token pick inside vLLM without the full-vocab gather.

vLLM computes the target's logits eagerly after its compiled forward
(``execute_model``: ``self.model.compute_logits(sample_hidden_states)``), all-gathers
the whole vocabulary, then samples (``_sample``: the Sampler, or the
RejectionSampler under speculative decoding) - for every request, greedy or not.
With COMMFOLD_VLLM=1 this hook decides per engine step, from the batch's sampling
parameters and the engine's speculative config only (every rank holds the same, so
every rank decides the same; commfold.vllm.target.decision):

- ``greedy``: every request greedy, nothing needing the whole row (penalties, bad
  words, allowed-token lists, active logits processors - min_tokens, logit_bias,
  custom ones -, thinking budgets, structured output, logprob_token_ids): the token
  per row is commfold.ops.local_argmax over the vocab shards (one (value, index)
  pair per row per rank), bit-identical to vLLM's greedy pick (first maximum, NaN
  included);
- ``verify``: the same under speculative decoding with strict greedy verification
  (``rejection_sample_method`` "standard"; synthetic, block, FLy, adaptive and
  unknown methods stay vLLM's): the target's argmax at every draft position and the
  bonus token, then vLLM's own accept/reject (``_rejection_greedy_sample``);
- ``logprobs``: greedy with logprobs=k (0 <= k <= 20, k * 64 <= vocab, logprobs_mode
  raw_logprobs or processed_logprobs, no spec decoding): commfold.ops.local_logprobs
  (two all-gathers of a few float64 and k candidates per row per rank), vLLM's top-k
  order among ties included;
- otherwise vLLM's own path, unchanged, for that step.

prompt_logprobs (k <= 20, k * 64 <= vocab, logprobs_mode raw/processed_logprobs)
go through local_logprobs too, per request, as vLLM computes them.

How: ``execute_model`` marks the step; the runner model's ``compute_logits`` (its
own code, with the logits processor's gather turned into the identity) returns this
rank's shard of the logits [rows, vocab shard] when the step qualifies, and picks
from it right there; ``_sample`` (vLLM's own, whole) hands that shard to the runner's
Sampler or RejectionSampler, which for that call answer the shard - only it, by
identity - with the pick (``_Answer``): nothing of vLLM's ``_sample`` is repeated. The
pick's collective runs where vLLM's gather would, inside ``execute_model``, not in
``sample_tokens``: vLLM's executor sends ``sample_tokens`` to each worker as a
separate call and answers the engine as soon as rank 0 is done, so vLLM's own
``sample_tokens`` (local on the gathered row) never waits for another rank, while a
collective there would make every step wait for the last rank to receive the call.
This is the V1 model runner's hook (Model Runner V2's is
commfold.vllm.target.target_pick_v2: the plugin installs the one of the runner vLLM will
build); at install it logs one line, on or off and why (vLLM's code moved
under the hook - the calls it relies on, checked by their source text;
commfold.vllm.compat.runtime). COMMFOLD_TARGET_PICK=0 turns only this hook off;
``commfold.vllm.target.switch.pause()`` switches the pick off and on at run time in a worker
(through ``LLM.collective_rpc``), to compare both paths on one engine. Decisions are
noted in the per-step collective log (COMMFOLD_COMM_LOG_DIR) as ``target_pick``.
"""
from __future__ import annotations

import logging
import os

import torch

from commfold.vllm.observe import step_log
from commfold.vllm.compat import hook_points, pins, runtime
from commfold.vllm.target.switch import ENV, enabled, paused
from commfold.vllm.target.decision import logprobs_mode_ok
from commfold.vllm.target.v1_picker import Picker

log = logging.getLogger("commfold")

HOOK = "target pick"
KEY = "target pick (V1)"  # its wrappers' mark (hook_points.wrap)
# what vLLM's code must still say for the hook to be right (module attr, text)
HOOK_POINTS = (
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
     "logits = self.model.compute_logits(sample_hidden_states)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
     "sampler_output = self._sample(logits, spec_decode_metadata)"),
    # _sample hands the step's logits, as it got them, to the runner's samplers
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
     "return self.sampler(\n                logits=logits,"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
     "sampler_output = self.rejection_sampler(\n            spec_decode_metadata,\n"
     "            draft_probs,\n            logits,"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_prompt_logprobs_dict",
     "logits = self.model.compute_logits(prompt_hidden_states)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_prompt_logprobs_dict",
     "scores = self.sampler.compute_logprobs(logits)"),
    ("vllm.model_executor.layers.logits_processor:LogitsProcessor._get_logits",
     "logits = self._gather_logits(logits)"),
    ("vllm.v1.sample.sampler:Sampler.forward", "raw_logprobs = self.compute_logprobs(logits)"),
    ("vllm.v1.sample.sampler:Sampler.sample", "greedy_sampled = self.greedy_sample(logits)"),
    ("vllm.v1.sample.sampler:Sampler.compute_logprobs",
     "logits.log_softmax(dim=-1, dtype=torch.float32)"),
    ("vllm.v1.sample.sampler:Sampler.gather_logprobs",
     "torch.topk(logprobs, num_logprobs, dim=-1)"),
    ("vllm.v1.sample.ops.logprobs:batched_count_greater_than", "(x >= values).sum(-1)"),
    ("vllm.v1.sample.rejection_sampler:rejection_sample",
     "target_argmax = target_logits.argmax(dim=-1)"),
    # the calls whose result the pick returns in their place (_Answer): read whole
    # (0.33's Sampler.forward adds a ROCm path for all-random batches only, its
    # RejectionSampler.forward FLy's arguments: neither reaches a step commfold takes)
    ("vllm.v1.sample.sampler:Sampler.forward",
     pins.pinned("vllm.v1.sample.sampler:Sampler.forward")),
    ("vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
     pins.pinned("vllm.v1.sample.rejection_sampler:RejectionSampler.forward")),
    ("vllm.v1.sample.rejection_sampler:rejection_sample", "_rejection_greedy_sample(\n"
     "            output_token_ids,\n            cu_num_draft_tokens,\n"
     "            draft_token_ids,\n            target_argmax,\n"
     "            bonus_token_ids,\n            is_greedy,\n            max_spec_len,\n"
     "            uniform_probs,\n            synthetic_conditional_rates,\n        )"),
)


# --- install -------------------------------------------------------------------------

def hook_points_missing() -> list[str]:
    """The hook points (see HOOK_POINTS) this vLLM no longer has, as 'where: text'."""
    return hook_points.missing(HOOK_POINTS)


def state(environ=os.environ, runner=None) -> runtime.HookState:
    """This hook's state and why (runtime.gate), installing nothing (Model Runner
    V2 has its own: commfold.vllm.target.target_pick_v2)."""
    return runtime.gate(HOOK, off=None if enabled(environ) else f"{ENV}=0",
                             missing=hook_points_missing, environ=environ, runner=runner)


_installed = False


def install(environ=os.environ, runner=None) -> bool:
    """Hook vLLM's V1 model runner (once per process), logging one line: on, or off
    and why (COMMFOLD_TARGET_PICK=0, Model Runner V2, vLLM's code moved under the
    hook). runner: runtime.runner_choice's answer, when the caller has it."""
    global _installed
    if _installed:
        return True
    if not state(environ, runner).log().on:
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name, make in (("execute_model", _execute_model), ("sample_tokens", _sample_tokens),
                       ("_sample", _sample), ("_get_prompt_logprobs_dict", _prompt_logprobs)):
        hook_points.wrap(GPUModelRunner, name, make, KEY)
    _installed = True
    return True


def uninstall() -> None:
    """Undo install() (tests: vLLM's own methods back on its runner class)."""
    global _installed
    hook_points.unwrap_hook(KEY)
    _installed = False


def _picker(runner) -> Picker | None:
    if "_commfold_picker" not in runner.__dict__:
        runner._commfold_picker = Picker.build(runner)
    return runner._commfold_picker


def _execute_model(original):
    def execute_model(self, scheduler_output, *args, **kwargs):
        picker = _picker(self) if getattr(self, "model", None) is not None else None
        if picker is None:
            return original(self, scheduler_output, *args, **kwargs)
        picker.pending, picker.scheduler_output, picker.in_execute = None, scheduler_output, True
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            picker.in_execute = False
    return execute_model


def _sample_tokens(original):
    def sample_tokens(self, grammar_output, *args, **kwargs):
        picker = self.__dict__.get("_commfold_picker")
        state = self.execute_model_state
        if picker is not None and picker.pending is not None and state is not None \
                and grammar_output is not None:  # never expected: structured steps stay
            self.execute_model_state = state._replace(  # on vLLM's path
                logits=picker.gather(picker.pending.shard))
            picker.pending = None
        return original(self, grammar_output, *args, **kwargs)
    return sample_tokens


def _sample(original):
    def _sample(self, logits, spec_decode_metadata):
        picker = self.__dict__.get("_commfold_picker")
        pending = picker.pending if picker is not None else None
        if pending is None or logits is not pending.shard:
            return original(self, logits, spec_decode_metadata)
        picker.pending = None
        if pending.mode == "logprobs" and spec_decode_metadata is not None:  # not expected
            return original(self, picker.gather(logits), spec_decode_metadata)
        samplers = {n: getattr(self, n) for n in ("sampler", "rejection_sampler")
                    if getattr(self, n, None) is not None}
        for name, inner in samplers.items():
            setattr(self, name, _Answer(inner, pending.shard,
                                        lambda: picker.sample(pending, spec_decode_metadata)))
        try:  # vLLM's _sample, whole: its samplers answer the shard with the pick
            return original(self, logits, spec_decode_metadata)
        finally:
            for name, inner in samplers.items():
                setattr(self, name, inner)
    return _sample


class _Answer:
    """vLLM's Sampler or RejectionSampler for one ``_sample`` call: called with the
    step's shard (by identity, at whatever argument position), commfold's
    SamplerOutput; any other call and every attribute, vLLM's object's."""

    def __init__(self, inner, shard, output):
        self._inner, self._shard, self._output = inner, shard, output

    def __call__(self, *args, **kwargs):
        if any(a is self._shard for a in (*args, *kwargs.values())):
            with step_log.phase("sampling"):
                return self._output()
        return self._inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _prompt_logprobs(original):
    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        picker = self.__dict__.get("_commfold_picker")
        wanted = getattr(self, "num_prompt_logprobs", None)
        if picker is None or not wanted:
            return original(self, hidden_states, num_scheduled_tokens)
        k = max(wanted.values())
        mode, reason = logprobs_mode_ok(k, self.model_config.logprobs_mode, picker.vocab)
        if min(wanted.values()) < 0:
            mode, reason = None, "prompt_logprobs=-1"
        if paused():
            mode, reason = None, "paused"
        step_log.note("prompt_logprobs", mode or f"vLLM ({reason})")
        if mode is None:
            return original(self, hidden_states, num_scheduled_tokens)
        sampler = self.sampler
        picker.prompt_k = k
        sampler.compute_logprobs = lambda logits: logits  # scores = the shard, marked
        sampler.gather_logprobs = lambda scores, n, token_ids: _prompt_gather(
            picker, scores, n, token_ids)
        try:
            return original(self, hidden_states, num_scheduled_tokens)
        finally:
            picker.prompt_k = None
            picker.prompt_shards.clear()
            del sampler.compute_logprobs, sampler.gather_logprobs
    return _get_prompt_logprobs_dict


def _prompt_gather(picker, scores, num_logprobs, token_ids):
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.sample.sampler import Sampler

    if picker.prompt_shards.pop(id(scores), None) is not scores:
        return Sampler.gather_logprobs(Sampler.compute_logprobs(scores), num_logprobs,
                                       token_ids)
    _, ids, lps, ranks = picker.logprobs(scores, num_logprobs, token_ids.long())
    return LogprobsTensors(ids.to(torch.int32), lps, ranks)
