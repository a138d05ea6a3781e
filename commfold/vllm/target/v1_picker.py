"""The V1 model runner's target pick for one runner: its model's vocab layout and TP
communicator, the step's decision (commfold.vllm.target.decision), and the local pick
from this rank's logits shard - greedy (commfold.ops.local_argmax), strict greedy
verification (vLLM's own ``_rejection_greedy_sample`` on the local argmax), logprobs
and prompt logprobs (commfold.ops.local_logprobs) - or the shard gathered back for
vLLM's own path. The hook that runs it inside vLLM is commfold.vllm.target.target_pick.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from commfold.ops import logprob_scan
from commfold.vllm.observe import step_log
from commfold.vllm.target import pick_cost
from commfold.vllm.target.decision import decide, verify_method, verify_refusal
from commfold.vllm.target.logits_head import LogitsHead
from commfold.vllm.target.switch import paused

log = logging.getLogger("commfold")


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
