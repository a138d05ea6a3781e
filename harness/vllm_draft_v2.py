"""Probabilistic drafting on Model Runner V2, both ways, then the verified step (tests
of commfold.vllm.spec_decode.draft_sampled): V2's own ``DraftModelSpeculator.sample_draft``
(``gumbel_sample`` over the gathered drafter logits, the draft cache written whole)
against the same method under commfold's hook, on vLLM's real ParallelLMHead +
LogitsProcessor in a vLLM TP group of spawned ranks, V2's Triton kernels in Triton's
interpreter. Each case drafts every step for its requests, then verifies the drafts
through V2's own ``GPUModelRunner.sample`` (harness.vllm_step_v2's runner and batch):
V2 with its whole cache, commfold's hooked sample with the partial one, and V2's
sample with the partial one (its RejectionSampler makes the rows whole first).
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import torch

from harness.vllm_step_v2 import START, model_state_hooks, new_draft_logits


def _speculator(model, fp64: bool):
    """What V2's sample_draft reads of a DraftModelSpeculator, nothing built."""
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    class Speculator(DraftModelSpeculator):
        capture = init_cudagraph_manager = load_draft_model = propose = None

    spec = Speculator.__new__(Speculator)
    spec.model, spec.use_local_argmax_reduction = model, False
    spec.acceptance_estimator = spec.draft_watermarker = None
    spec.use_fp64_gumbel = fp64
    spec.speculative_config = SimpleNamespace(draft_sample_method="probabilistic")
    spec.vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                        enable_batch_sharded_sampling=False),
        lora_config=None)
    return spec


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN included)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(bits),
                                              b.contiguous().view(bits))


def _cache_reads(cache, lay, rank: int, slots, steps, tokens):
    """What commfold's verification reads of the cache on `rank`: its blocks' columns
    and its own columns at the drafted steps, and each drafted token's entry."""
    lo, hi = lay.span(rank)
    s, e = lay.columns(rank)
    out = [cache[slots, :steps, lo:hi], cache[slots, :steps, s:e]]
    for i in range(steps):
        out.append(cache[slots, i, tokens[i][:len(slots)]])  # the slotless row last
    return out


def draft_cases(world: int, cases: list[dict]) -> list[dict]:
    """In a spawned rank: each case drafted both ways and verified three ways. case:
    vocab, dtype, seed, ties, row_params (the requests' SamplingParams), steps, keep
    (per request the drafts scheduled: a prefix), fp64, nan_column (the drafter's),
    pad_row (a drafting row without a slot), draft_vocab (the drafter's, if not the
    target's)."""
    from harness import triton_cpu

    triton_cpu.install()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (what vLLM's CPU worker imports first)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    from commfold.config import Config
    from commfold.vllm.spec_decode import draft, draft_sampled, draft_v2
    from commfold.vllm.spec_decode.draft_choice import PICK
    from commfold.vllm.compat.runtime import Runner
    from harness.vllm_tp import init_vllm_tp

    tp = init_vllm_tp(world, shm=False, reuse=True)
    sample = GPUModelRunner.__dict__["sample"]
    drafted = DraftModelSpeculator.__dict__["sample_draft"]
    drafted = getattr(drafted, "__wrapped__", drafted)
    draft_v2.hook(Config(passes=("local_argmax",)), True, False)  # as loaded
    assert draft_sampled.install({}, Runner(2, "test")), "the hook is off"
    out = []
    try:
        for case in cases:
            out.append(_case(case, tp.rank_in_group, world, sample, drafted))
    finally:
        draft_sampled.uninstall()
        draft.uninstall(PICK)
    return out


def _case(case, rank: int, world: int, sample, drafted) -> dict:
    """One case in a rank (see draft_cases); sample / drafted: V2's own methods."""
    from vllm import SamplingParams

    from commfold.distributed.comm_log import record_collectives
    from commfold.shard.layout import Layout
    from commfold.vllm.spec_decode import draft_cache
    from commfold.vllm.observe import step_log
    from harness import vllm_step
    from harness.vllm_step_v2 import _vocab_gathers, hooked_sample, input_batch, runner, valid

    dtype = getattr(torch, case["dtype"])
    vocab, steps = case["vocab"], case["steps"]
    dvocab = case.get("draft_vocab", vocab)
    params = [SamplingParams(**p) for p in case["row_params"]]
    reqs = len(params)
    target = vllm_step.TinyLM(vocab, dtype, case["seed"], case["ties"])
    drafter = vllm_step.TinyLM(dvocab, dtype, case["seed"] + 100, case["ties"],
                               nan_column=case.get("nan_column"))
    runners = []
    for _ in range(3):
        np.random.seed(case["seed"])  # V2 draws an unseeded request's seed from numpy
        runners.append(runner(target, vocab, params, steps, model_state=model_state_hooks()))
    # what the speculators hold (from 0.34 DraftLogitsCaches), and their tensors
    holders, caches = zip(*(new_draft_logits(steps, dvocab, dtype) for _ in range(2)))
    specs = [_speculator(drafter, case.get("fp64", False)) for _ in range(2)]
    rows = reqs + bool(case.get("pad_row"))
    slots = torch.arange(rows)
    if case.get("pad_row"):
        slots[-1] = -1
    notes: list[str] = []
    note = step_log.note
    step_log.note = lambda key, value, notes=notes: notes.append(f"{key}: {value}")
    tokens, same_tokens, draft_bytes, vllm_bytes, draft_gathers = [], True, [], [], 0
    try:
        for i in range(steps):
            h = vllm_step.hidden(rows, dtype, case["seed"] + 10 + i, case["ties"])
            pos = torch.full((rows,), START + i, dtype=torch.int64)
            col = torch.tensor(i, dtype=torch.int64)
            got = []
            for k, (spec, cache, r) in enumerate(zip(specs, holders, runners)):
                states = r.sampler.sampling_states
                args = (h, pos, slots, states.temperature.gpu, states.seeds.gpu, col, cache)
                with record_collectives() as log:
                    got.append(drafted(spec, *args) if k == 0 else spec.sample_draft(*args))
                if k == 0:
                    vllm_bytes.append(log.bytes())
                else:
                    draft_bytes.append(log.bytes())
                    draft_gathers += _vocab_gathers(log, drafter.head[0].weight.shape[0])
            same_tokens &= torch.equal(got[0], got[1])
            tokens.append(got[0])
        shard = drafter.head[0].weight.shape[0]
        lay = Layout(shard, dvocab, world)
        real = slots[slots >= 0]
        theirs_reads = _cache_reads(caches[0], lay, rank, real, steps, tokens)
        ours_reads = _cache_reads(caches[1], lay, rank, real, steps, tokens)
        same_reads = all(map(_same_bits, theirs_reads, ours_reads))
        partial = draft_cache.of(caches[1])
        dirty = None if partial is None else partial.dirty[:reqs].tolist()

        # the verified step: the drafts (a prefix per request) as the next step's inputs
        keep = case.get("keep") or [steps] * reqs
        drafts = [[int(tokens[i][r]) for i in range(keep[r])] for r in range(reqs)]
        batch = input_batch(drafts)
        hv = vllm_step.hidden(batch.num_tokens, dtype, case["seed"] + 1, case["ties"])
        fallback_holder, fallback_cache = new_draft_logits(steps, dvocab, dtype)
        fallback_cache.copy_(caches[1])
        if partial is not None:
            setattr(fallback_cache, draft_cache.ATTR, copy.deepcopy(partial))
        runners[0].speculator.draft_logits = holders[0]
        runners[1].speculator.draft_logits = holders[1]
        runners[2].speculator.draft_logits = fallback_holder
        notes.append("verify")
        with record_collectives() as vllm_log:
            theirs = sample(runners[0], hv, batch, None)[0]
        with record_collectives() as ours_log:
            ours = hooked_sample(sample, runners[1], hv, batch)
        with record_collectives() as fallback_log:
            fallback = sample(runners[2], hv, batch, None)[0]
        # what the verification read, with the target's layout: V2's values
        vlay = Layout(target.head[0].weight.shape[0], min(vocab, dvocab), world)
        verified_reads = all(map(_same_bits, *(
            _cache_reads(c, vlay, rank, real, steps, tokens) for c in caches)))
        whole = _same_bits(fallback_cache[:reqs, :, :dvocab], caches[0][:reqs])
    finally:
        step_log.note = note
    return dict(
        case=case, rank=rank, notes=notes, same_tokens=same_tokens,
        tokens=[t.tolist() for t in tokens], same_reads=same_reads, dirty=dirty,
        ours=valid(ours), theirs=valid(theirs), fallback=valid(fallback),
        counts=(ours.num_sampled.tolist(), ours.num_rejected.tolist()),
        vllm_counts=(theirs.num_sampled.tolist(), theirs.num_rejected.tolist()),
        fallback_counts=(fallback.num_sampled.tolist(), fallback.num_rejected.tolist()),
        whole_after_fallback=whole, verified_reads=verified_reads, draft_bytes=draft_bytes,
        vllm_draft_bytes=vllm_bytes,
        draft_gathers=draft_gathers, verify_bytes=ours_log.bytes(),
        verify_gathers=_vocab_gathers(ours_log, target.head[0].weight.shape[0]),
        vllm_verify_bytes=vllm_log.bytes(), fallback_bytes=fallback_log.bytes(),
        shard=shard, accepted=[k - 1 for k in theirs.num_sampled.tolist()])
