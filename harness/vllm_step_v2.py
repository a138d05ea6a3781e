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


def sampler_for(vocab: int, params: list, steps: int, logprobs_mode: str = "raw_logprobs"):
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
                      logprobs_mode=logprobs_mode, num_speculative_tokens=steps + 1)
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


def runner(model, vocab: int, params: list, steps: int, logprobs_mode: str = "raw_logprobs"):
    """What V2's GPUModelRunner.sample (and commfold's hook) read of the runner."""
    sampler, rejection, spec = sampler_for(vocab, params, steps, logprobs_mode)
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
        mode = case.get("logprobs_mode", "raw_logprobs")
        theirs_runner = runner(model, case["vocab"], params, steps, mode)
        ours_runner = runner(model, case["vocab"], params, steps, mode)
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
            vllm_gathers=_vocab_gathers(vllm_log, shard),
            logprobs=_logprobs(ours), vllm_logprobs=_logprobs(theirs),
            ranks=_ranks(model.compute_logits(h[batch.logits_indices]), ours),
            score_diff=_score_diff(ours, theirs)))
    return out


def _logprobs(out):
    """(token ids, ranks) of a SamplerOutput's logprobs, None without."""
    t = out.logprobs_tensors
    if t is None:
        return None
    return t.logprob_token_ids.tolist(), t.selected_token_ranks.tolist(), str(t.logprobs.dtype)


def logprobs_agree(r: dict) -> bool:
    """Ours and V2's logprobs: the same ids and dtype; the ranks V2 computes on a GPU.
    V2's rank kernel under Triton's interpreter counts bf16 logits wrongly (its masked
    lanes' -inf compares as >= the token's), so bf16 ranks are checked against torch,
    float32 ones against V2 too."""
    ours, theirs = r["logprobs"], r["vllm_logprobs"]
    if ours is None or theirs is None:
        return ours is theirs
    same = ours[0] == theirs[0] and ours[2] == theirs[2] and ours[1] == r["ranks"]
    return same and (r["case"]["dtype"] != "float32" or ours[1] == theirs[1])


def _ranks(logits, out):
    """What V2's rank kernel computes on a GPU - how many logits are >= the token's -
    for the tokens `out` sampled, in torch (None without logprobs)."""
    if out.logprobs_tensors is None:
        return None
    tokens = out.sampled_token_ids[:, :1]
    return (logits >= logits.gather(1, tokens)).sum(-1).tolist()


def _score_diff(ours, theirs):
    """Largest |difference| of the two outputs' scores (equal where both are -inf or
    NaN), in float32 ulps of the row's log-sum-exp L (column 0 scores the greedy token,
    the maximum: logprob -L; logits modes: of the logit), where the float32 sums'
    rounding lands; None when either has no logprobs."""
    if ours.logprobs_tensors is None or theirs.logprobs_tensors is None:
        return None
    a, b = ours.logprobs_tensors.logprobs, theirs.logprobs_tensors.logprobs
    if a.shape != b.shape:
        return float("inf")
    same = (a == b) | (a.isnan() & b.isnan())
    big = torch.maximum(b[:, :1].abs(), torch.ones_like(b[:, :1])).expand_as(b)
    ulp = torch.nextafter(big, torch.full_like(big, float("inf"))) - big
    return float(((a - b).abs() / ulp).where(~same, torch.zeros_like(a)).max())


def _vocab_gathers(log, shard: int) -> int:
    return len([e for e in log.events if e.name in ("all_gather", "gather")
                and any(s and s[-1] >= shard for s in e.shapes)])


def prompt_cases(world: int, cases: list[dict]) -> list[dict]:
    """In a spawned rank: V2's compute_prompt_logprobs_with_chunking for each case's
    prompt positions, as vLLM ships it and under commfold's hook (the head found from a
    V2 runner's sample(), as in an engine step); ids, ranks, score differences, the
    hook's note, collectives. case: vocab, dtype, seed, ties, rows, k, logprobs_mode,
    chunk (V2's CHUNK_SIZE for the case), targets_outside (a target past the vocab)."""
    from harness import triton_cpu

    triton_cpu.install()
    import vllm.v1.worker.cpu.shm  # noqa: F401
    from vllm.v1.worker.gpu.sample import prompt_logprob

    from commfold.distributed.comm_log import record_collectives
    from commfold.vllm import step_log, target_pick_v2
    from harness import vllm_step
    from harness.vllm_tp import init_vllm_tp

    tp = init_vllm_tp(world, shm=False, reuse=True)
    original = prompt_logprob.compute_prompt_logprobs_with_chunking
    original = getattr(original, "__wrapped__", original)
    hooked = target_pick_v2._prompt_scores(original)
    chunk_size = prompt_logprob.CHUNK_SIZE
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        model = vllm_step.TinyLM(case["vocab"], dtype, case["seed"], case["ties"])
        h = vllm_step.hidden(case["rows"], dtype, case["seed"] + 1, case["ties"])
        g = torch.Generator().manual_seed(case["seed"] + 2)
        targets = torch.randint(0, case["vocab"], (case["rows"],), generator=g)
        if case.get("targets_outside"):
            targets[-1] = case["vocab"] + 3
        target_pick_v2._last_head = target_pick_v2._head(
            runner(model, case["vocab"], [], 0))
        prompt_logprob.CHUNK_SIZE = case.get("chunk", chunk_size)
        args = (targets, h, model.compute_logits, case["k"],
                case.get("logprobs_mode", "raw_logprobs"))
        notes: list[str] = []
        note = step_log.note
        step_log.note = lambda key, value, notes=notes: notes.append(value)
        try:
            with record_collectives() as theirs_log:
                theirs = original(*args)
            with record_collectives() as ours_log:
                ours = hooked(*args)
        finally:
            step_log.note = note
            prompt_logprob.CHUNK_SIZE = chunk_size
            target_pick_v2._last_head = None
        logits = model.compute_logits(h)
        inside = targets < case["vocab"]
        want_ranks = (logits >= logits.gather(1, targets.clamp(max=case["vocab"] - 1)[:, None])
                      ).sum(-1)
        shard = model.head[0].weight.shape[0]
        out.append(dict(
            case=case, rank=tp.rank_in_group, notes=notes,
            ids=ours[0].tolist() == theirs[0].tolist(),
            ranks=bool((ours[2] == want_ranks)[inside].all()),
            vllm_ranks=ours[2].tolist() == theirs[2].tolist(),
            score_diff=_score_diff(*(SimpleNamespace(logprobs_tensors=SimpleNamespace(
                logprobs=x[1])) for x in (ours, theirs))),
            ours_gathers=_vocab_gathers(ours_log, shard), calls=ours_log.calls(),
            vllm_gathers=_vocab_gathers(theirs_log, shard)))
    return out
