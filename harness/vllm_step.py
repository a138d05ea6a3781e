"""One engine step's logits and token pick, both ways, in a vLLM TP group of rank-pool
processes (tests and benchmarks of commfold.vllm.target.target_pick): vLLM's real
ParallelLMHead and LogitsProcessor (TinyLM), a stand-in for what the hook reads of
vLLM's model runner (its model, input batch, sampler), and ``step_both_ways`` - the
hook's local shard and pick, and vLLM's full gather with its own Sampler /
RejectionSampler."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from commfold.distributed.ranks import environment

H = 48
PAD_VALUE = 7.0  # padding rows: larger logits than any real row for an all-ones hidden


class TinyLM(torch.nn.Module):
    """The logits end of a vLLM causal LM (Llama's compute_logits). tied: Gemma's
    instead - no lm_head, the logits from the input embedding (``self.model.
    embed_tokens``), soft-capped at `soft_cap`."""

    def __init__(self, vocab: int, dtype, seed: int, ties: bool, hidden: int = H,
                 nan_column: int | None = None, tied: bool = False,
                 soft_cap: float | None = None, neg_inf_rows: tuple[int, ...] = ()):
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead, VocabParallelEmbedding)

        super().__init__()
        if tied:
            self.model = torch.nn.Module()
            self.model.embed_tokens = head = VocabParallelEmbedding(vocab, hidden,
                                                                    params_dtype=dtype)
        else:
            self.lm_head = head = ParallelLMHead(vocab, hidden, params_dtype=dtype)
        self.head = [head]  # not a submodule: the one compute_logits uses
        self.logits_processor = LogitsProcessor(vocab, soft_cap=soft_cap)
        self.neg_inf_rows = list(neg_inf_rows)  # rows whose every logit is -inf
        g = torch.Generator().manual_seed(seed)
        full = torch.randint(-1, 2, (vocab, hidden), generator=g).float() if ties else \
            torch.randn(vocab, hidden, generator=g) / hidden ** 0.5
        if nan_column is not None:
            full[nan_column] = float("nan")  # that token's logit NaN in every row
        idx = head.shard_indices
        n = idx.org_vocab_end_index - idx.org_vocab_start_index
        with torch.no_grad():
            head.weight.fill_(PAD_VALUE)
            head.weight[:n] = full[idx.org_vocab_start_index:idx.org_vocab_end_index]
        head.quant_method.process_weights_after_loading(head)

    def compute_logits(self, hidden):
        return self._masked(self.logits_processor(self.head[0], hidden))

    def compute_logits_local(self, hidden):
        """This rank's [rows, vocab shard] (Llama's: vLLM's batch-sharded sampling)."""
        return self._masked(self.logits_processor(self.head[0], hidden, skip_gather=True))

    def _masked(self, logits):
        rows = [r for r in self.neg_inf_rows if r < logits.shape[0]]
        if rows:
            logits[rows] = float("-inf")
        return logits


class TinyLMGatherOnly(TinyLM):
    """A model without compute_logits_local (most of vLLM's)."""
    compute_logits_local = None


def hidden(rows: int, dtype, seed: int, ties: bool, special: str | None = None,
           width: int = H):
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-1, 2, (rows, width), generator=g).float() if ties else \
        torch.randn(rows, width, generator=g)
    h[0] = 1.0  # all ones: an unmasked padding row would win row 0
    if special == "nan" and rows > 1:
        h[1, 3] = float("nan")  # a NaN row of logits
    if special == "inf" and rows > 1:
        h[1] = float("inf")  # +-inf and NaN (inf * 0) logits
    if special == "inf1" and rows > 1:
        h[1] = 0.0
        h[1, 3] = float("inf")  # +-inf logits, no NaN (weights without zeros)
    return h.to(dtype)


def runner(model, md, logprobs_mode="raw_logprobs"):
    """What the hook reads of vLLM's GPUModelRunner."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode=logprobs_mode)
    return SimpleNamespace(
        model=model, input_batch=SimpleNamespace(sampling_metadata=md), sampler=sampler,
        rejection_sampler=RejectionSampler(sampler), lora_config=None,
        speculative_config=SimpleNamespace(rejection_sample_method="standard"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1), broadcast_pp_output=False,
        model_config=SimpleNamespace(logprobs_mode=logprobs_mode))


def metadata(rows: int, k: int | None, vocab: int):
    """An all-greedy SamplingMetadata as vLLM's input batch builds it."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=k, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows), output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def spec_metadata(drafts: list[list[int]]):
    """SpecDecodeMetadata as the runner lays out logits rows: per request its draft
    positions, then its bonus position."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    target, bonus, row = [], [], 0
    for d in drafts:
        target += list(range(row, row + len(d)))
        bonus.append(row + len(d))
        row += len(d) + 1
    n = [len(d) for d in drafts]
    i32 = dict(dtype=torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), **i32), num_draft_tokens=n,
        cu_num_draft_tokens=torch.tensor(n, **i32).cumsum(0, dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor([x + 1 for x in n], **i32).cumsum(0, dtype=torch.int32),
        target_logits_indices=torch.tensor(target, **i32),
        bonus_logits_indices=torch.tensor(bonus, **i32),
        logits_indices=torch.arange(row, dtype=torch.int32))


def step_both_ways(model, md, h, spec=None, logprobs_mode="raw_logprobs", cost_rule=False):
    """(commfold's SamplerOutput, vLLM's SamplerOutput, the mode the hook chose and
    why, the collectives each way); cost_rule: the pick's cost rule as users get it
    (off by default: these steps test the pick on tiny vocabularies)."""
    from commfold.distributed.comm_log import record_collectives
    from commfold.vllm.target.target_pick import Picker

    r = runner(model, md, logprobs_mode)
    picker = Picker.build(r)
    assert picker is not None
    r._commfold_picker = picker
    picker.scheduler_output = SimpleNamespace(
        scheduled_spec_decode_tokens={"a": [0]} if spec is not None else {},
        has_structured_output_requests=False)
    rule = {} if cost_rule else {"COMMFOLD_PICK_COST_RULE": "0"}
    with record_collectives() as ours_log, environment(rule):
        picker.in_execute = True
        logits = model.compute_logits(h)
        pending = picker.pending
        mode = pending.mode if pending is not None else None
        ours = picker.sample(pending, spec) if pending is not None else None
    with record_collectives() as vllm_log:
        full = model.compute_logits(h)  # not inside execute_model: vLLM's path
        if spec is None:
            theirs = r.sampler(logits=full, sampling_metadata=md)
        else:
            theirs = r.rejection_sampler(spec, None, full, md)
    return dict(ours=ours, theirs=theirs, mode=mode, shard=tuple(logits.shape),
                ours_log=ours_log, vllm_log=vllm_log)


def hook_v2_draft_pick():
    """V2's drafter pick hooked as the plugin hooks it (local_argmax only); returns
    vLLM's own ``DraftModelSpeculator.sample_draft``, the reference to compare with."""
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    from commfold.config import Config
    from commfold.vllm.spec_decode import draft_v2

    original = DraftModelSpeculator.__dict__["sample_draft"]
    original = getattr(original, "__wrapped__", original)
    draft_v2.hook(Config(passes=("local_argmax",)), True, True)
    return original
