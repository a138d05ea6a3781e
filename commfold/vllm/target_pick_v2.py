"""The target model's token pick on vLLM's Model Runner V2 without the full-vocab
gather: the same rules as the V1 hook (commfold.vllm.target_pick), one patch.

V2's ``GPUModelRunner.sample(hidden_states, input_batch, grammar_output)`` computes
the logits (``self.model.compute_logits``: all-gathered over the vocab), then runs its
Sampler, or its RejectionSampler when the step verifies drafts. This hook wraps
``sample`` and decides per step from what V2's Sampler holds about the step's
requests (commfold.vllm.decision.decide_v2: the same on every rank):

- ``greedy``: every request greedy, no logits processing, no top-k / top-p, no
  logprobs: the token per row is commfold.ops.local_argmax over the model's own
  logits shard (one (value, index) pair per row per rank);
- ``verify``: the same under spec decoding with strict greedy verification: the
  target's argmax at every row, then V2's accept rule (a draft is accepted while it
  equals the target's argmax and is not a placeholder; the first rejected position
  and the bonus position take the target's argmax), drafts read by V2's own
  ``gather_draft_sampled``;
- ``logprobs``: greedy as above, with top logprobs (k <= 20, 64 k <= vocab, no
  logprob_token_ids, no spec decoding): V2's ``compute_topk_scores`` - the token and
  torch.topk of the logits, their logprobs (or logits), the token's rank - from two
  small all-gathers (commfold.ops.local_logprobs.local_topk_scores); ids and ranks
  exact, logprobs within a few float32 ulps of V2's (its log-sum-exp sums in another
  order); rows it cannot do exactly are gathered and scored by V2's own function;
- prompt logprobs (V2's ``compute_prompt_logprobs_with_chunking``, after ``sample``:
  k <= 20, 64 k <= vocab) the same way per chunk of prompt positions, scoring each
  position's next prompt token (decide_v2_prompt);
- anything else, and batch-sharded sampling unless the step qualifies (commfold's
  pick moves 16 bytes per row from each peer, its all-to-all a row's whole vocab
  shard), runs V2's own ``sample``.

V2 takes its greedy argmax in Triton kernels whose pick on a row holding NaN depends
on the kernel's reduction order; commfold's scan sees NaN in the gathered maxima (the
same on every rank) and gives such a step to V2's samplers, after gathering the
logits as vLLM does. Ties and -inf rows: the first maximum, as V2's kernels.

Logged once at install, on or off and why (runtime.gate with the V2 runner);
COMMFOLD_TARGET_PICK=0 turns it off; ``target_pick.pause()`` sends steps to
vLLM's path. Decisions go to the step log as ``target_pick``.
"""
from __future__ import annotations

import logging
import os

import torch

from commfold import cost
from commfold.vllm import step_log
from commfold.vllm import hook_points
from commfold.vllm import runtime
from commfold.vllm import target_pick
from commfold.vllm.decision import V2Step, decide_v2, decide_v2_prompt, verify_method
from commfold.vllm.logits_head import LogitsHead

log = logging.getLogger("commfold")

HOOK = "target pick"  # the same row as V1's hook: one per engine
_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_REJECT = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
_PROMPT = "vllm.v1.worker.gpu.sample.prompt_logprob"
HOOK_POINTS = (
    (f"{_RUNNER}.sample", "logits = self.model.compute_logits(sample_hidden_states)"),
    (f"{_RUNNER}.sample", "sampler_output = self.sampler(logits, input_batch)"),
    (f"{_RUNNER}.sample", "self.speculator.draft_logits"),
    ("vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
     "logits_mode=self.logprobs_mode in (\"raw_logits\", \"processed_logits\")"),
    ("vllm.v1.worker.gpu.sample.logprob:compute_topk_scores",
     "topk_indices = torch.topk(logits, num_logprobs, dim=-1).indices"),
    ("vllm.v1.worker.gpu.sample.logprob:_topk_log_softmax_kernel",
     "o = logits - max_val - lse"),
    ("vllm.v1.worker.gpu.sample.logprob:_ranks_kernel",
     "n += tl.sum((logits >= x).to(tl.int32))"),
    (f"{_RUNNER}.sample",
     "return sampler_output, sampler_output.num_sampled, sampler_output.num_rejected"),
    ("vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
     "input_batch.seq_lens.new_ones(input_batch.num_reqs)"),
    ("vllm.v1.worker.gpu.sample.sampler:Sampler.sample",
     "self.sampling_states.get_top_k_top_p("),
    ("vllm.v1.worker.gpu.sample.states:SamplingStates.add_request",
     "return temperature != 0.0 and ("),
    (f"{_REJECT}:RejectionSampler.__call__", "draft_sampled, pos = gather_draft_sampled("),
    ("vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils:",  # in _rejection_kernel
     "accepted = target_argmax == draft_sampled"),
    ("vllm.model_executor.layers.logits_processor:LogitsProcessor._get_logits",
     "logits = self._gather_logits(logits)"),
    (f"{_PROMPT}:PromptLogprobsWorker.compute_prompt_logprobs",
     "compute_prompt_logprobs_with_chunking("),
    (f"{_PROMPT}:compute_prompt_logprobs_with_chunking",
     "prompt_logits = logits_fn(prompt_hidden_states[start_idx:end_idx])"),
    (f"{_PROMPT}:compute_prompt_logprobs_with_chunking", "result = compute_topk_scores("),
    (f"{_PROMPT}:CHUNK_SIZE", None),
)


def hook_points_missing() -> list[str]:
    return hook_points.missing(HOOK_POINTS)


def state(environ=os.environ, runner=None) -> runtime.HookState:
    """This hook's state and why, installing nothing."""
    off = None if target_pick.enabled(environ) else f"{target_pick.ENV}=0"
    return runtime.gate(HOOK, off=off, missing=hook_points_missing, environ=environ,
                             runner=runner, version=2)


_installed = False


def install(environ=os.environ, runner=None) -> bool:
    """Wrap V2's GPUModelRunner.sample (once per process), logging one line."""
    global _installed
    if _installed:
        return True
    if not state(environ, runner).log().on:
        return False
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm.v1.worker.gpu.sample import prompt_logprob

    for owner, name, make in ((GPUModelRunner, "sample", _sample),
                              (prompt_logprob, "compute_prompt_logprobs_with_chunking",
                               _prompt_scores)):
        original = getattr(owner, name)
        if not getattr(original, "_commfold_target_pick", False):
            wrapped = make(original)
            wrapped.__wrapped__, wrapped.__name__ = original, name
            wrapped._commfold_target_pick = True
            setattr(owner, name, wrapped)
    _installed = True
    return True


_last_head: LogitsHead | None = None  # the head of the runner whose sample() ran last


def _prompt_scores(original):
    """V2's compute_prompt_logprobs_with_chunking, locally where decide_v2_prompt
    qualifies the step (the same k, mode and vocab on every rank)."""
    def compute_prompt_logprobs_with_chunking(prompt_token_ids, prompt_hidden_states,
                                              logits_fn, num_prompt_logprobs,
                                              logprobs_mode="raw_logprobs"):
        from vllm.v1.worker.gpu.sample.prompt_logprob import CHUNK_SIZE

        args = (prompt_token_ids, prompt_hidden_states, logits_fn, num_prompt_logprobs,
                logprobs_mode)
        head = _last_head
        if head is None or getattr(logits_fn, "__self__", None) is not head.model:
            mode, why = None, "no target pick head for this model"
        elif target_pick._paused:
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
            scores = logprobs_scores(head, shard, num_prompt_logprobs, logits_mode, chunk)
            parts.append(tensors(head, shard, scores, logits_mode))
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))
    return compute_prompt_logprobs_with_chunking



def _head(runner) -> LogitsHead | None:
    if "_commfold_head" not in runner.__dict__:
        head, why = LogitsHead.find(runner)
        if head is None:
            log.info("commfold: target pick off for this model: %s", why)
        runner._commfold_head = head
    return runner._commfold_head


def step_of(runner, input_batch, vocab: int = 0) -> V2Step:
    """What V2's Sampler holds about the step's requests (V2's own arrays)."""
    sampler = runner.sampler
    idx = input_batch.idx_mapping_np
    idx = idx[idx >= 0]
    states = sampler.sampling_states
    dims = sampler.get_logprobs_dims(idx)
    return V2Step(
        temperatures=tuple(float(t) for t in states.temperature.np[idx]),
        top_k_or_p=bool((states.top_k.np[idx] != states.vocab_size).any()
                        or (states.top_p.np[idx] != 1.0).any()),
        needs_processing=bool(sampler.needs_logits_processing[idx].any()),
        logprobs=dims is not None, num_logprobs=dims[0] if dims else 0,
        logprob_token_ids=bool(dims and dims[1]), logprobs_mode=str(sampler.logprobs_mode),
        vocab=vocab, sampler=type(sampler).__name__,
        trace_replay=getattr(sampler, "trace_replay_state", None) is not None,
        sampling_mask=bool(getattr(sampler, "return_sampling_mask", False)),
        nan_check=bool(getattr(sampler, "compute_nans", False)))


def decide(runner, input_batch, grammar_output, vocab: int = 0) -> tuple[str | None, str]:
    if target_pick._paused:
        return None, "paused"
    if runner.sampler is None or input_batch.num_reqs == 0:
        return None, "no sampler or no requests on this rank"
    spec = input_batch.num_draft_tokens > 0 and runner.rejection_sampler is not None
    verify = verify_method(getattr(runner, "speculative_config", None),
                           runner.rejection_sampler) if spec else None
    if spec and type(runner.rejection_sampler).__name__ != "RejectionSampler":
        return None, f"rejection sampler {type(runner.rejection_sampler).__name__}"
    return decide_v2(step_of(runner, input_batch, vocab), spec=spec,
                     structured=grammar_output is not None, verify=verify)


def _sample(original):
    def sample(self, hidden_states, input_batch, grammar_output):
        global _last_head
        head = _last_head = _head(self)
        if head is None:
            return original(self, hidden_states, input_batch, grammar_output)
        mode, why = decide(self, input_batch, grammar_output, head.vocab)
        if mode is not None and getattr(self, "batch_sharder", None) is not None:
            site = cost.Site(cost.BATCH_SHARDED_PICK, hidden_states.device.type,
                             dtype=hidden_states.dtype,
                             rows=int(input_batch.logits_indices.shape[0]),
                             vocab=head.vocab, world=head.world)
            slower = cost.why_slower(site)
            if slower:
                mode, why = None, slower
        step_log.note("target_pick", mode or f"vLLM ({why})")
        if mode is None:
            return original(self, hidden_states, input_batch, grammar_output)
        shard = head.local_logits(hidden_states[input_batch.logits_indices])
        if shard is None:
            self._commfold_head = None
            return original(self, hidden_states, input_batch, grammar_output)
        with step_log.phase("sampling"):
            out = pick(self, head, shard, input_batch, mode)
        return out, out.num_sampled, out.num_rejected
    return sample


def pick(runner, head: LogitsHead, shard, input_batch, mode: str):
    """V2's SamplerOutput for the step, from this rank's logits shard."""
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    from commfold.ops.local_argmax import local_argmax

    scores = None
    if mode == "logprobs":
        idx = input_batch.idx_mapping_np
        k = runner.sampler.get_logprobs_dims(idx[idx >= 0])[0]
        scores = logprobs_scores(head, shard, k, _logits_mode(runner))
        values, tokens = scores.maxima, scores.tokens
    else:
        values, tokens = local_argmax(shard, head.vocab, head.comm)
    if values.isnan().any():  # gathered maxima: the same on every rank
        step_log.note("target_pick", "vLLM (NaN logits: V2's own pick)")
        return _vllm_samplers(runner, head.gather(shard), input_batch)
    prefill_len = runner.sampler.req_states.prefill_len.gpu
    if mode == "verify":
        sampled, num_sampled = verify(runner, input_batch, tokens, prefill_len)
    else:
        sampled = tokens.view(-1, 1)
        num_sampled = input_batch.seq_lens.new_ones(input_batch.num_reqs)
    num_sampled, num_rejected = get_num_sampled_and_rejected(
        num_sampled, input_batch.seq_lens, input_batch.cu_num_logits,
        input_batch.idx_mapping, prefill_len)
    logprobs = None
    if scores is not None:
        from vllm.v1.outputs import LogprobsTensors

        logprobs = LogprobsTensors(*tensors(head, shard, scores, _logits_mode(runner)))
    return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs,
                         num_nans=None, num_sampled=num_sampled, num_rejected=num_rejected)


def _logits_mode(runner) -> bool:
    return runner.sampler.logprobs_mode in ("raw_logits", "processed_logits")


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


def verify(runner, input_batch, argmax, prefill_len):
    """V2's strict greedy verification from the target's argmax per logits row:
    (sampled [reqs, steps + 1], num_sampled [reqs] int32)."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled

    draft, _ = gather_draft_sampled(
        input_batch.input_ids, input_batch.positions, input_batch.logits_indices,
        input_batch.expanded_idx_mapping, input_batch.expanded_local_pos, prefill_len)
    cu = torch.as_tensor(input_batch.cu_num_logits_np, dtype=torch.int64)
    reqs, steps = input_batch.num_reqs, runner.rejection_sampler.num_speculative_steps
    counts = (cu[1:] - cu[:-1]).to(argmax.device)
    req = torch.repeat_interleave(torch.arange(reqs, device=argmax.device), counts)
    col = torch.arange(argmax.shape[0], device=argmax.device) - cu.to(argmax.device)[req]
    nxt = torch.cat([draft[1:], draft.new_full((1,), -1)]).to(argmax.dtype)
    bonus = col == (counts - 1)[req]
    ok = (argmax == nxt) & (nxt >= 0) & ~bonus
    accepted = torch.zeros(reqs, steps + 1, dtype=torch.bool, device=argmax.device)
    target = torch.zeros(reqs, steps + 1, dtype=torch.int64, device=argmax.device)
    drafts = torch.zeros_like(target)
    accepted[req, col], target[req, col], drafts[req, col] = ok, argmax, nxt
    length = accepted.to(torch.int32).cumprod(1).sum(1)  # drafts accepted per request
    cols = torch.arange(steps + 1, device=argmax.device)
    sampled = torch.where(cols < length[:, None], drafts, target)
    return sampled, (length + 1).to(torch.int32)


def _vllm_samplers(runner, logits, input_batch):
    """The tail of V2's sample() on gathered logits (steps commfold gives back)."""
    if input_batch.num_draft_tokens == 0 or runner.rejection_sampler is None:
        return runner.sampler(logits, input_batch)
    return runner.rejection_sampler(logits, input_batch, runner.speculator.draft_logits,
                                    None)
