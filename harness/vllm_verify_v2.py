"""Spec-decode steps with sampled requests through Model Runner V2's own
``GPUModelRunner.sample`` (its real Sampler, RejectionSampler, InputBatch on vLLM's
real ParallelLMHead + LogitsProcessor), once as vLLM ships it and once under
commfold's hook (commfold.vllm.spec_decode.shard_verify), in a vLLM TP group of spawned ranks.
Built on harness.vllm_step_v2's runner and batch; adds the drafter's cached logits
(V2's ``speculator.draft_logits``) and drafts chosen to be accepted or rejected.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from harness.vllm_step_v2 import new_draft_logits


def draft_logits(logits: torch.Tensor, batch, steps: int, noise: float, seed: int,
                 dtype):
    """V2's draft logits cache [MAX_REQS, steps, vocab] (filled with 0.0, as V2 fills
    it): request r's step i holds the target's logits of its row i plus noise. Up to
    vLLM 0.33 the tensor itself; from 0.34 V2's DraftLogitsCache (replicated, as
    without batch-sharded sampling) holding it."""
    g = torch.Generator().manual_seed(seed + 5)
    holder, cache = new_draft_logits(steps, logits.shape[1], dtype)
    cu = batch.cu_num_logits_np
    for r in range(len(cu) - 1):
        for i in range(int(cu[r + 1] - cu[r]) - 1):
            row = logits[int(cu[r]) + i].float()
            cache[r, i] = (row + noise * torch.randn(row.shape, generator=g)).to(dtype)
    return holder


def _drafts(case: dict, model, batch, h) -> None:
    """Drafts of the case's kind written into the batch's input ids: "top" the
    target's most likely token at the row before (mostly accepted), "random" uniform
    ids (mostly rejected), "mixed" alternating, "edge" the last vocab id and 0."""
    kind = case.get("draft_kind", "mixed")
    full = model.compute_logits(h[batch.logits_indices]).float()
    g = torch.Generator().manual_seed(case["seed"] + 9)
    ids, cu = batch.input_ids, batch.cu_num_logits_np
    for r in range(len(cu) - 1):
        lo, n = int(cu[r]), int(cu[r + 1] - cu[r]) - 1
        for i in range(n):
            top = int(full[lo + i].argmax())
            rand = int(torch.randint(0, case["vocab"], (1,), generator=g))
            pick = {"top": top, "random": rand, "mixed": top if (r + i) % 3 != 2 else rand,
                    "edge": case["vocab"] - 1 if i % 2 == 0 else 0,
                    "fixed": case.get("fixed", [0] * (r + 1))[r]}[kind]
            ids[lo + 1 + i] = pick


def verify_cases(world: int, cases: list[dict]) -> list[dict]:
    """In a spawned rank: each case's spec-decode step through V2's sample, as vLLM
    ships it and under commfold's hook; tokens, counts, the hook's decision, the
    collectives (calls, bytes, vocab-wide gathers). case: vocab, dtype, seed, ties,
    drafts (per request its number of drafts), row_params, draft_logits (noise scale,
    None: one-hot drafts), draft_kind, placeholder, history (harness.vllm_step_v2's),
    scale (of the hidden states: peaked rows)."""
    from harness import triton_cpu

    triton_cpu.install()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (what vLLM's CPU worker imports first)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from commfold.distributed.comm_log import record_collectives
    from commfold.vllm.observe import step_log
    from harness import vllm_step
    from harness.vllm_step_v2 import (_histories, _logprobs, _params, _score_diff,
                                      _vocab_gathers, hooked_sample, input_batch,
                                      model_state_hooks, runner, valid, wide_gathers)
    from harness.vllm_tp import init_vllm_tp

    tp = init_vllm_tp(world, shm=False, reuse=True)
    original = GPUModelRunner.__dict__["sample"]
    states = model_state_hooks()  # from vLLM 0.34
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        model = vllm_step.TinyLM(case["vocab"], dtype, case["seed"], case["ties"],
                                 nan_column=case.get("nan_column"),
                                 neg_inf_rows=case.get("neg_inf_rows", ()))
        drafts = [[7] * n for n in case["drafts"]]
        params = [_params(p) for p in case["row_params"]]
        steps = max(case["drafts"])
        batch = input_batch(drafts, case.get("placeholder"))
        h = vllm_step.hidden(batch.num_tokens, dtype, case["seed"] + 1, case["ties"],
                             case.get("special")) * case.get("scale", 1.0)
        _drafts(case, model, batch, h)
        cache = None
        if case.get("draft_logits") is not None:
            full = model.compute_logits(h[batch.logits_indices])
            cache = draft_logits(full, batch, steps, case["draft_logits"], case["seed"],
                                 dtype)
        runners = []
        for _ in range(2):
            np.random.seed(case["seed"])  # V2 draws an unseeded request's seed from numpy
            r = runner(model, case["vocab"], params, steps,
                       case.get("logprobs_mode", "raw_logprobs"), model_state=states,
                       histories=_histories(case, len(params)),
                       reasoning=case.get("reasoning"))
            r.speculator.draft_logits = cache
            runners.append(r)
        cut: dict = {"v2": [], "ours": []}  # the processed (cut) target, both ways
        with record_collectives() as vllm_log, _processed_logits(runners[0], cut):
            theirs = original(runners[0], h, batch, None)[0]
        notes: list[str] = []
        note = step_log.note
        step_log.note = lambda key, value, notes=notes: notes.append(value)
        try:
            with record_collectives() as ours_log, _verified_shard(cut):
                ours = hooked_sample(original, runners[1], h, batch)
        finally:
            step_log.note = note
        shard = model.head[0].weight.shape[0]
        out.append(dict(
            case=case, rank=tp.rank_in_group, notes=notes, ours=valid(ours),
            theirs=valid(theirs),
            counts=(ours.num_sampled.tolist(), ours.num_rejected.tolist()),
            vllm_counts=(theirs.num_sampled.tolist(), theirs.num_rejected.tolist()),
            dtype=(ours.sampled_token_ids.dtype, theirs.sampled_token_ids.dtype),
            accepted=[k - 1 for k in theirs.num_sampled.tolist()],
            ours_gathers=_vocab_gathers(ours_log, shard), calls=ours_log.calls(),
            wide=wide_gathers(ours_log, shard), shard=shard,
            bytes=ours_log.bytes(), vllm_bytes=vllm_log.bytes(),
            vllm_gathers=_vocab_gathers(vllm_log, shard),
            same_cut=_same_cut(cut, tp.rank_in_group * shard, case["vocab"]),
            logprobs=_logprobs(ours), vllm_logprobs=_logprobs(theirs),
            ranks=_ranks(model.compute_logits(h[batch.logits_indices]), ours, theirs,
                         runners[0].sampler, batch), score_diff=_score_diff(ours, theirs)))
    return out


@contextlib.contextmanager
def _processed_logits(runner, into: dict):
    """V2's processed target logits (its apply_sampling_params: the top-k / top-p cut
    included), each call's kept in into["v2"]."""
    sampler = runner.sampler
    original = sampler.apply_sampling_params

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        into["v2"].append(out.clone())
        return out

    sampler.apply_sampling_params = spy
    try:
        yield
    finally:
        del sampler.apply_sampling_params


@contextlib.contextmanager
def _verified_shard(into: dict):
    """The shard commfold's verification processed and cut (Verified.processed), kept
    in into["ours"]."""
    from commfold.vllm.spec_decode import shard_verify

    original = shard_verify.verify

    def spy(*args, **kwargs):
        got = original(*args, **kwargs)
        if not isinstance(got, str):
            into["ours"].append(got.processed.clone())
        return got

    shard_verify.verify = spy
    try:
        yield
    finally:
        shard_verify.verify = original


def _same_cut(cut: dict, start: int, vocab: int) -> bool | None:
    """Whether this rank's processed, cut columns are V2's, bit for bit (None: a side
    did not process the logits, or the step was given back)."""
    if not cut["v2"] or len(cut["ours"]) != 1:
        return None
    v2 = torch.cat(cut["v2"])
    ours = cut["ours"][0]
    n = max(0, min(ours.shape[1], vocab - start))
    a, b = ours[:, :n], v2[:, start:start + n]
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(0.0), b.nan_to_num(0.0)))


def _ranks(logits, out, theirs, sampler, batch):
    """The ranks V2's rank kernel computes on a GPU for the tokens `out` scores (column
    0 of its logprob ids: each verified row's token): counted in torch on the raw
    logits, or V2's own where it scores processed (float32) logits; None without."""
    if out.logprobs_tensors is None:
        return None
    if sampler.logprobs_mode.startswith("processed") and \
            bool(sampler.needs_logits_processing[batch.idx_mapping_np].any()):
        return theirs.logprobs_tensors.selected_token_ranks.tolist()
    tokens = out.logprobs_tensors.logprob_token_ids[:, :1].long()
    return (logits >= logits.gather(1, tokens)).sum(-1).tolist()


def method_refusals(world: int, configs: dict) -> dict:
    """In a spawned rank: per method, V2's RejectionSampler built from the speculative
    config `configs[method]` (fields over harness.vllm_step_v2's "standard" one) for a
    sampled spec-decode step: (what it was built for, shard_verify.refusal, decide_step's
    (mode, reason)); None where this release will not build it."""
    from harness import triton_cpu

    triton_cpu.install()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (what vLLM's CPU worker imports first)
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    from commfold.vllm.spec_decode import shard_verify
    from commfold.vllm.target import v2_pick
    from commfold.vllm.target.decision import _sampler_method
    from harness.vllm_step_v2 import input_batch, sampler_for

    out = {}
    for method, fields in configs.items():
        sampler, _, spec = sampler_for(1000, [SamplingParams(temperature=0.8, seed=1)], 2)
        spec = SimpleNamespace(**{**spec.__dict__, **fields})
        try:
            rejection = RejectionSampler(sampler, spec, torch.device("cpu"))
        except (AssertionError, AttributeError, TypeError):
            out[method] = None
            continue
        out[method] = (_sampler_method(rejection), shard_verify.refusal(rejection),
                       v2_pick.decide_step(sampler, rejection, spec, input_batch([[5, 6]]),
                                           False, 1000))
    return out


def launch_arguments(world: int, form: tuple[int, ...] | None = None) -> dict:
    """In a spawned rank: per kernel commfold.vllm.spec_decode.verify_kernels launches, (the
    argument names it passes, launch options left out; the installed kernel's
    parameter names), from each launch function run on stand-in tensors with the
    kernel replaced by a recorder. form: a release in place of verify_kernels.form
    (another release's lists, for a check by its sources)."""
    from harness import triton_cpu

    triton_cpu.install()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (what vLLM's CPU worker imports first)
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as ru

    from commfold.vllm.spec_decode import verify_kernels

    got: dict = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(**kw):
                got[self.name] = sorted(k for k in kw if k not in ("num_warps",))
            return launch

    names = ("_compute_local_logits_stats_kernel", "_rejection_kernel", "_resample_kernel",
             "_insert_resampled_kernel")
    params = {n: sorted(getattr(ru, n).arg_names) for n in names}
    saved = {n: getattr(ru, n) for n in names}
    installed = verify_kernels.form
    try:
        for n in names:
            setattr(ru, n, Recorder(n))
        if form is not None:
            verify_kernels.form = lambda: form
        t = torch.zeros(2, 2)
        i = torch.zeros(2, dtype=torch.int64)
        verify_kernels.stats((2, 1), t, t, t, t, t, t, 2, None, i, i, t, 1)
        verify_kernels.rejection(SimpleNamespace(fly_entropy_threshold=0.3), t, i, i, i, t,
                                 t, t, t, i, None, t, t, i, i, t, i, i, 1, 1)
        verify_kernels.resample(SimpleNamespace(may_mask_logits=np.zeros(2, dtype=bool)),
                                np.arange(1), t, t, t, i, None, i, i, i, i, i, t, i, i, 2,
                                False)
        verify_kernels.insert(t, i, t, t, i, i, t, 2)
    finally:
        verify_kernels.form = installed
        for n, k in saved.items():
            setattr(ru, n, k)
    return {n: (got[n], params[n]) for n in names}
