"""One Model Runner V2 sampling step both ways, in a vLLM TP group of rank-pool
processes spawned for V2 (tests of commfold.vllm.target_pick_v2): vLLM's real
ParallelLMHead + LogitsProcessor (harness.vllm_step.TinyLM), V2's real Sampler,
RejectionSampler, RequestState and InputBatch, and V2's own
``GPUModelRunner.sample`` run on a stand-in runner holding what it reads - once as
vLLM ships it, once wrapped by commfold's hook.

Nothing here imports vLLM at module level: ``step_cases`` installs the Triton CPU
stand-in (harness.triton_cpu) first, so V2's Triton kernels run in the interpreter.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

MAX_REQS = 16
START = 40  # the position of each request's first scheduled token (past its prefill)


def sampler_for(vocab: int, params: list, steps: int):
    """V2's Sampler (+ RejectionSampler when steps > 0) with `params` (SamplingParams)
    added as requests 0..n-1, as the runner adds them."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu.states import RequestState

    cpu = torch.device("cpu")
    states = RequestState(MAX_REQS, 256, 256, max(steps, 1), vocab, cpu)
    for i in range(len(params)):
        states.add_request(f"r{i}", START, list(range(START)), 0, 16)
    states.apply_staged_writes()
    sampler = Sampler(VllmConfig(), MAX_REQS, vocab, cpu, states,
                      num_speculative_tokens=steps + 1)
    for i, p in enumerate(params):
        sampler.add_request(i, p)
    sampler.apply_staged_writes()
    spec = SimpleNamespace(num_speculative_tokens=steps, enable_adaptive_verification=False,
                           rejection_sample_method="standard", synthetic_acceptance_rates=None,
                           fly_window_size=None, fly_entropy_threshold=None,
                           fly_entropy_top_k=None)
    rejection = RejectionSampler(sampler, spec, cpu) if steps else None
    return sampler, rejection, spec


def input_batch(drafts: list[list[int]], placeholder: int | None = None):
    """V2's InputBatch for one decode step: request r schedules its last token and
    its drafts (all rows are logits rows). placeholder: a request whose drafts V2
    reads as placeholders (its step starts inside its prefill)."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    n = [len(d) + 1 for d in drafts]
    reqs, tokens = len(drafts), sum(n)
    cu = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    req = np.repeat(np.arange(reqs), n)
    local = np.arange(tokens) - cu[:-1][req]
    ids = np.concatenate([[7] + d for d in drafts]).astype(np.int32)
    pos = START + local
    if placeholder is not None:
        pos[req == placeholder] -= START  # before its prefill ends
    i64 = dict(dtype=torch.int64)
    seq_lens = torch.tensor([START + k for k in n], dtype=torch.int32)
    return InputBatch(
        req_ids=[f"r{i}" for i in range(reqs)], num_reqs=reqs, num_reqs_after_padding=reqs,
        idx_mapping=torch.arange(reqs, **i64), idx_mapping_np=np.arange(reqs),
        expanded_idx_mapping=torch.tensor(req, **i64),
        expanded_local_pos=torch.tensor(local, dtype=torch.int32),
        num_scheduled_tokens=np.array(n, dtype=np.int32), num_tokens=tokens,
        num_tokens_after_padding=tokens, num_draft_tokens=tokens - reqs,
        num_draft_tokens_per_req=np.array(n, dtype=np.int32) - 1,
        query_start_loc=torch.tensor(cu), query_start_loc_np=cu, seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens.clone(), dcp_local_seq_lens=None,
        num_computed_tokens_np=np.full(reqs, START, dtype=np.int32),
        prefill_len_np=np.full(reqs, START, dtype=np.int32),
        num_computed_prefill_tokens_np=np.full(reqs, START, dtype=np.int32),
        is_prefilling_np=np.zeros(reqs, dtype=bool), has_prefill=False,
        decode_graph_eligible=True, input_ids=torch.tensor(ids),
        positions=torch.tensor(pos, **i64), is_padding=torch.zeros(tokens, dtype=torch.bool),
        logits_indices=torch.arange(tokens, **i64), cu_num_logits=torch.tensor(cu),
        cu_num_logits_np=cu, has_structured_output_reqs=False, prompt_lens=None)


def runner(model, vocab: int, params: list, steps: int):
    """What V2's GPUModelRunner.sample (and commfold's hook) read of the runner."""
    sampler, rejection, spec = sampler_for(vocab, params, steps)
    return SimpleNamespace(
        model=model, sampler=sampler, rejection_sampler=rejection, batch_sharder=None,
        speculator=SimpleNamespace(draft_logits=None), speculative_config=spec if steps
        else None, structured_outputs_worker=None, vocab_size=vocab, lora_config=None,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1))


def valid(out) -> list[list[int]]:
    """The sampled tokens V2's postprocessing reads: the first num_sampled per row."""
    return [row[:k] for row, k in zip(out.sampled_token_ids.tolist(), out.num_sampled.tolist())]


def step_cases(world: int, cases: list[dict]) -> list[dict]:
    """In a spawned rank: each case's step through V2's sample, as vLLM ships it and
    under commfold's hook; tokens, counts, the hook's decision, collectives."""
    from harness import triton_cpu

    triton_cpu.install()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (what vLLM's CPU worker imports first)
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from commfold.vllm import step_log as vllm_comm_log
    from commfold.vllm import target_pick_v2 as vllm_target_pick_v2
    from commfold.distributed.comm_log import record_collectives
    from harness import vllm_step
    from harness.vllm_tp import init_vllm_tp

    tp = init_vllm_tp(world, shm=False, reuse=True)
    original = GPUModelRunner.__dict__["sample"]
    hooked = vllm_target_pick_v2._sample(original)
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        # a NaN column, not a NaN row: Triton's interpreter fails on an all-NaN block
        model = vllm_step.TinyLM(case["vocab"], dtype, case["seed"], case["ties"],
                                 nan_column=case.get("nan_column"),
                                 tied=case.get("tied", False), soft_cap=case.get("soft_cap"))
        drafts = case.get("drafts") or [[] for _ in range(case["rows"])]
        params = [SamplingParams(**case.get("params", {}) or dict(temperature=0.0))
                  for _ in drafts]
        steps = max(len(d) for d in drafts)
        batch = input_batch(drafts, case.get("placeholder"))
        h = vllm_step.hidden(batch.num_tokens, dtype, case["seed"] + 1, case["ties"],
                             case.get("special"))
        if case.get("accept"):  # drafts from the target's argmax (some accepted)
            full = model.compute_logits(h).float().argmax(-1)
            ids = batch.input_ids
            for r, d in enumerate(drafts):
                lo = int(batch.cu_num_logits_np[r])
                for i in range(len(d)):
                    ids[lo + 1 + i] = int(full[lo + i]) if (r + i) % 3 != 2 else 0
        theirs_runner = runner(model, case["vocab"], params, steps)
        ours_runner = runner(model, case["vocab"], params, steps)
        with record_collectives() as vllm_log:
            theirs = original(theirs_runner, h, batch, None)[0]
        notes: list[str] = []
        note = vllm_comm_log.note
        vllm_comm_log.note = lambda key, value, notes=notes: notes.append(value)
        try:
            with record_collectives() as ours_log:
                ours = hooked(ours_runner, h, batch, None)[0]
        finally:
            vllm_comm_log.note = note
        shard = model.head[0].weight.shape[0]
        out.append(dict(
            case=case, rank=tp.rank_in_group, notes=notes,
            ours=valid(ours), theirs=valid(theirs),
            counts=(ours.num_sampled.tolist(), ours.num_rejected.tolist()),
            vllm_counts=(theirs.num_sampled.tolist(), theirs.num_rejected.tolist()),
            dtype=(ours.sampled_token_ids.dtype, theirs.sampled_token_ids.dtype),
            ours_gathers=_vocab_gathers(ours_log, shard), calls=ours_log.calls(),
            vllm_gathers=_vocab_gathers(vllm_log, shard)))
    return out


def _vocab_gathers(log, shard: int) -> int:
    return len([e for e in log.events if e.name in ("all_gather", "gather")
                and any(s and s[-1] >= shard for s in e.shapes)])
