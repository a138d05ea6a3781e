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
from dataclasses import dataclass

import torch

from commfold.vllm.observe import step_log
from commfold.vllm.compat import hook_points, pins, runtime
from commfold.vllm.target import pick_cost
from commfold.vllm.target.switch import ENV, enabled, paused
from commfold.vllm.target.logits_head import LogitsHead
from commfold.ops import logprob_scan
# the per-step decision lives in decision (shared by the runner hooks); its
# names stay importable from here
from commfold.vllm.target.decision import (LOGPROB_MODES, MAX_LOGPROBS, active_processors,  # noqa: F401
                            decide, logprobs_mode_ok, verify_method, verify_refusal)

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


# --- one runner's picker -----------------------------------------------------------

@dataclass
class _Pending:
    shard: torch.Tensor
    mode: str
    picked: tuple  # Picker.pick's result, made in execute_model (see the module doc)


class Picker:
    """The runner model's vocab layout and TP communicator, and the step's state."""

    def __init__(self, runner, head: LogitsHead):
        self.runner, self.head = runner, head
        self.model, self.processor = head.model, head.processor
        self.comm, self.vocab, self.shard = head.comm, head.vocab, head.shard
        self.in_execute = False  # inside execute_model, before its compute_logits
        self.scheduler_output = None
        self.pending: _Pending | None = None
        self.prompt_k: int | None = None  # inside _get_prompt_logprobs_dict, qualified
        self.prompt_shards: dict[int, torch.Tensor] = {}
        original = self.model.compute_logits
        self.model.compute_logits = lambda hidden, *a, **kw: self._compute_logits(
            original, hidden, *a, **kw)

    @staticmethod
    def build(runner):
        """The runner's picker, or None (logged once) when its model or setup does not
        fit: everything checked here is the same on every rank."""
        head, why = LogitsHead.find(runner)
        if head is None:
            log.info("commfold: target pick off for this model: %s", why)
            return None
        if getattr(runner, "speculative_config", None) is not None:
            refusal = verify_refusal(_verify_method(runner))
            if refusal is not None:  # greedy decoding steps are still picked locally
                log.warning("commfold: target pick leaves spec-decode verification to "
                            "vLLM: %s", refusal)
        # logprobs steps use a C++ scan: load it now (built once per machine, ~30 s;
        # not in a background thread: one killed inside torch's build lock leaves the
        # lock behind, and every later load waits on it)
        logprob_scan.module()  # the vocab scans (vocab_scan_cpu.cpp)
        return Picker(runner, head)

    # compute_logits: the shard when the step qualifies
    def _compute_logits(self, original, hidden, *args, **kwargs):
        if self.in_execute and not args and not kwargs:
            self.in_execute = False
            mode, reason = self._decide()
            # the cost table, from the step's shape (every rank alike)
            mode, reason = pick_cost.gate(mode, reason, hidden.shape[0], hidden, self.head)
            step_log.note("target_pick", mode or f"vLLM ({reason})")
            shard = self.local_logits(original, hidden) if mode is not None else None
            if shard is not None:
                with step_log.phase("sampling"):
                    self.pending = _Pending(shard, mode, self.pick(shard, mode))
                return shard
        elif self.prompt_k is not None and not args and not kwargs:
            shard = self.local_logits(original, hidden)
            if shard is not None:
                self.prompt_shards[id(shard)] = shard
                return shard
        return original(hidden, *args, **kwargs)

    def local_logits(self, original, hidden):
        """This rank's [rows, shard] from the model's own compute_logits (LogitsHead);
        None turns the hook off for this runner."""
        out = self.head.local_logits(hidden, original)
        if out is None:
            self.runner._commfold_picker = None
        return out

    def _decide(self):
        from vllm import envs

        if paused():
            return None, "paused"
        r, so = self.runner, self.scheduler_output
        return decide(r.input_batch.sampling_metadata,
                      spec=bool(getattr(so, "scheduled_spec_decode_tokens", None)),
                      structured=bool(getattr(so, "has_structured_output_requests", False)),
                      logprobs_mode=r.sampler.logprobs_mode, vocab=self.vocab,
                      nan_check=bool(envs.VLLM_COMPUTE_NANS_IN_LOGITS),
                      verify=_verify_method(r))

    def gather(self, shard):
        return self.head.gather(shard)

    # the step's pick: its collectives, then vLLM's output from it
    def pick(self, shard, mode: str) -> tuple:
        """The step's pick from this rank's shard, every rank together: (argmax per
        row,) for greedy and verify, local_logprobs' (tokens, ids, logprobs, ranks)."""
        from commfold.ops.local_argmax import local_argmax

        if mode != "logprobs":
            return (local_argmax(shard, self.vocab, self.comm)[1],)
        return self.logprobs(shard, self.runner.input_batch.sampling_metadata.max_num_logprobs)

    def sample(self, pending: _Pending, spec_metadata):
        """vLLM's SamplerOutput for the step, from the pick made in execute_model (no
        collective here)."""
        from vllm.v1.outputs import LogprobsTensors, SamplerOutput

        if spec_metadata is not None:  # greedy verification (logprobs never get here)
            return self._verify(pending.picked[0], spec_metadata)
        tokens = pending.picked[0].to(torch.int32).unsqueeze(-1)
        if pending.mode != "logprobs":
            return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)
        _, ids, lps, ranks = pending.picked
        return SamplerOutput(sampled_token_ids=tokens,
                             logprobs_tensors=LogprobsTensors(ids.to(torch.int32), lps, ranks))

    def logprobs(self, shard, k, targets=None):
        from commfold.ops.local_logprobs import local_logprobs

        return local_logprobs(shard, self.vocab, self.comm, k, _vllm_logprobs, targets)

    def _verify(self, argmax, meta):
        from vllm.v1.outputs import SamplerOutput
        from vllm.v1.sample import rejection_sampler as rs

        bonus = argmax[meta.bonus_logits_indices].to(torch.int32).unsqueeze(-1)
        out = torch.full((len(meta.num_draft_tokens), meta.max_spec_len + 1),
                         rs.PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=argmax.device)
        rs._rejection_greedy_sample(out, meta.cu_num_draft_tokens, meta.draft_token_ids,
                                    argmax[meta.target_logits_indices], bonus, None,
                                    meta.max_spec_len, None, None)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def _verify_method(runner) -> str:
    """The runner's spec-decode verification method (decision.verify_method)."""
    return verify_method(getattr(runner, "speculative_config", None),
                         getattr(runner, "rejection_sampler", None))


def _vllm_logprobs(full, tokens, k):
    """vLLM's own logprobs of whole rows (rows local_logprobs does not do locally)."""
    from vllm.v1.sample.sampler import Sampler

    t = Sampler.gather_logprobs(Sampler.compute_logprobs(full), k, tokens.long())
    return t.logprob_token_ids, t.logprobs, t.selected_token_ranks


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
