"""commfold's target pick (commfold.vllm.target.target_pick) against vLLM's own Sampler and
RejectionSampler, on vLLM's real ParallelLMHead + LogitsProcessor in a vLLM TP=2
group (shared memory, and the gloo fallback), without an engine: one engine step's
logits computed both ways - the hook's local shard and pick, vLLM's full gather and
sampler - must give bit-identical tokens, the same logprob token ids in vLLM's
order (torch.topk's heap order among ties: integer logits full of ties), the same
ranks, logprobs within float32 rounding of vLLM's, and no vocab-wide gather. The
per-step decision is checked for each kind of sampling parameter through vLLM's own
InputBatch; the hook points are checked against the installed vLLM."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commfold.vllm.compat.runtime import Runner
from harness.vllm_models import init_vllm_tp, require_vllm_installed, shm_supported

pytestmark = require_vllm_installed()

LP_ATOL = 2e-5  # vLLM sums exp() over the row in float32, commfold in float64


def _compare(res, k):
    """Differences between commfold's and vLLM's SamplerOutput, as strings."""
    ours, theirs = res["ours"], res["theirs"]
    bad = []
    if not torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids):
        bad.append(f"tokens {ours.sampled_token_ids.tolist()} != "
                   f"{theirs.sampled_token_ids.tolist()}")
    if k is None:
        if ours.logprobs_tensors is not None or theirs.logprobs_tensors is not None:
            bad.append("logprobs where none were asked for")
        return bad
    a, b = ours.logprobs_tensors, theirs.logprobs_tensors
    if a.logprob_token_ids.dtype != b.logprob_token_ids.dtype or \
            not torch.equal(a.logprob_token_ids, b.logprob_token_ids):
        bad.append(f"ids {a.logprob_token_ids.tolist()} != {b.logprob_token_ids.tolist()}")
    if not torch.equal(a.selected_token_ranks, b.selected_token_ranks):
        bad.append(f"ranks {a.selected_token_ranks.tolist()} != "
                   f"{b.selected_token_ranks.tolist()}")
    same_special = torch.equal(a.logprobs.isnan(), b.logprobs.isnan()) and torch.equal(
        a.logprobs.isinf(), b.logprobs.isinf())
    finite = a.logprobs.isfinite()
    if a.logprobs.shape != b.logprobs.shape or not same_special or not torch.allclose(
            a.logprobs[finite], b.logprobs[finite], rtol=0, atol=LP_ATOL):
        bad.append(f"logprobs {a.logprobs.tolist()} != {b.logprobs.tolist()}")
    return bad


def _vocab_gathers(log, shard):
    return [e for e in log.events if e.name in ("all_gather", "gather")
            and any(s and s[-1] >= shard for s in e.shapes)]


def _run_cases(shm: bool, cases: list[dict]):
    from harness import vllm_step as tc
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # as vLLM's CPU worker does
    tp = init_vllm_tp(2, shm=shm, reuse=True)
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        model = tc.TinyLM(case["vocab"], dtype, case["seed"], case["ties"],
                          tied=case.get("tied", False), soft_cap=case.get("soft_cap"))
        spec = tc.spec_metadata(case["drafts"]) if case.get("drafts") else None
        rows = spec.logits_indices.numel() if spec is not None else case["rows"]
        h = tc.hidden(rows, dtype, case["seed"] + 1, case["ties"], case.get("special"))
        if spec is not None and case.get("accept"):  # drafts = the target's argmax
            am = model.compute_logits(h).float().argmax(-1)  # (some accepted)
            spec.draft_token_ids.copy_(torch.where(torch.arange(len(spec.target_logits_indices))
                                                   % 3 == 2, 0, am[spec.target_logits_indices]))
        k = case.get("k")
        md = tc.metadata(len(case.get("drafts") or []) or rows, k, case["vocab"])
        res = tc.step_both_ways(model, md, h, spec, case.get("logprobs_mode", "raw_logprobs"))
        shard = model.head[0].weight.shape[0]
        out.append(dict(case=case, mode=res["mode"], shard=res["shard"],
                        bad=_compare(res, k) if res["ours"] is not None else ["no local pick"],
                        ours_gathers=len(_vocab_gathers(res["ours_log"], shard)),
                        vllm_gathers=len(_vocab_gathers(res["vllm_log"], shard)),
                        ours_calls=res["ours_log"].calls(), rank=tp.rank_in_group))
    return out


def _check(results, expect_mode=None):
    for res in results:
        for r in res:
            where = f"rank {r['rank']} {r['case']}"
            assert r["bad"] == [], where + ": " + "; ".join(r["bad"])
            assert r["mode"] == (expect_mode or r["case"]["mode"]), where
            assert r["shard"][-1] < r["case"]["vocab"], where  # the hook kept the shard
            whole = r["mode"] == "logprobs" and bool(r["case"].get("special"))
            assert r["ours_gathers"] == whole and r["vllm_gathers"] == 1, where
            # greedy / verify: one pair exchange; logprobs: two (+1 for whole rows)
            want = 1 if r["mode"] != "logprobs" else 2 + bool(r["case"].get("special"))
            assert r["ours_calls"] == want, where


V = 1500  # padded to 1536: shards of 768, rank 1 holds 732 real columns + 36 padding
CASES = [
    dict(vocab=V, dtype="float32", seed=1, ties=True, rows=7, mode="greedy"),
    dict(vocab=V, dtype="bfloat16", seed=2, ties=False, rows=1, mode="greedy"),
    dict(vocab=V, dtype="float32", seed=11, ties=True, rows=3, mode="greedy", special="inf"),
    dict(vocab=V, dtype="float32", seed=3, ties=True, rows=5, k=5, mode="logprobs"),
    dict(vocab=V, dtype="bfloat16", seed=4, ties=True, rows=6, k=20, mode="logprobs"),
    dict(vocab=V, dtype="float32", seed=5, ties=False, rows=3, k=0, mode="logprobs"),
    dict(vocab=V, dtype="bfloat16", seed=6, ties=False, rows=4, k=1, mode="logprobs",
         logprobs_mode="processed_logprobs"),
    dict(vocab=V, dtype="float32", seed=7, ties=True, rows=4, k=5, mode="logprobs",
         special="nan"),
    dict(vocab=V, dtype="float32", seed=8, ties=True, rows=4, k=3, mode="logprobs",
         special="inf"),
    dict(vocab=V, dtype="float32", seed=9, ties=True, drafts=[[1, 2, 3], [4], [5, 6]],
         accept=True, mode="verify"),
    dict(vocab=V, dtype="bfloat16", seed=10, ties=False, drafts=[[1, 2], [3, 4, 5]],
         accept=True, mode="verify"),
    # a tied head (Gemma's: logits from the input embedding, soft-capped)
    dict(vocab=V, dtype="bfloat16", seed=12, ties=False, rows=5, mode="greedy", tied=True,
         soft_cap=30.0),
    dict(vocab=V, dtype="float32", seed=13, ties=True, rows=4, k=5, mode="logprobs",
         tied=True, soft_cap=30.0),
    dict(vocab=V, dtype="float32", seed=14, ties=True, drafts=[[1, 2], [3]], accept=True,
         mode="verify", tied=True),
]


def test_pick_equals_vllms_sampler(vllm_ranks):
    """vLLM's default CPU communicator (shared memory; gloo where the CPU's vLLM
    build has none). The gloo fallback: test_pick_equals_vllms_sampler_gloo."""
    _check(vllm_ranks.run(_run_cases, shm_supported(), CASES))


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vocab=st.integers(1280, 2100), dtype=st.sampled_from(["float32", "bfloat16"]),
       rows=st.integers(1, 9), k=st.sampled_from([None, 0, 2, 5, 20]),
       ties=st.booleans(), seed=st.integers(0, 2**16))
def test_pick_equals_vllms_sampler_examples(vllm_ranks, vocab, dtype, rows, k, ties, seed):
    """Odd vocab sizes (padding on the last shard), both dtypes, with and without
    ties; k <= 20 with 64 k <= vocab keeps vLLM's topk on the order it reproduces."""
    case = dict(vocab=vocab, dtype=dtype, seed=seed, ties=ties, rows=rows, k=k,
                mode="greedy" if k is None else "logprobs")
    _check(vllm_ranks.run(_run_cases, shm_supported(), [case]))


# --- the decision, from SamplingParams through vLLM's own InputBatch -----------------

def _metadata_for(params, vocab=V, custom=()):
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import build_logitsprocs
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    cpu = torch.device("cpu")
    batch = InputBatch(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=64,
                       device=cpu, vocab_size=vocab, block_sizes=[16],
                       max_num_blocks_per_req=[4],
                       logitsprocs=build_logitsprocs(VllmConfig(), cpu, False, False, custom))
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        batch.add_request(CachedRequestState(
            req_id=f"r{i}", prompt_token_ids=[1, 2, 3], mm_features=[], sampling_params=p,
            generator=gen, block_ids=([0],), num_computed_tokens=0, output_token_ids=[]))
    batch.refresh_metadata()
    return batch.sampling_metadata


def _greedy(**kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, **kw)


def _bad_words():
    p = _greedy()
    p._bad_words_token_ids = [[7], [8, 9]]  # what the tokenizer makes of bad_words
    return p


DECISIONS = {
    "greedy": ([_greedy, _greedy], {}, "greedy"),
    "greedy, spec decode": ([_greedy], dict(spec=True, verify="standard"), "verify"),
    "greedy, spec decode, FLy": ([_greedy], dict(spec=True, verify="fly"), None),
    "greedy, spec decode, method unknown": ([_greedy], dict(spec=True), None),
    "one request sampled": ([_greedy, lambda: __import__("vllm").SamplingParams(
        temperature=0.8, seed=3)], {}, None),
    "repetition penalty": ([lambda: _greedy(repetition_penalty=1.2)], {}, None),
    "frequency penalty": ([lambda: _greedy(frequency_penalty=0.5)], {}, None),
    "presence penalty": ([lambda: _greedy(presence_penalty=0.5)], {}, None),
    "min_tokens": ([lambda: _greedy(min_tokens=3)], {}, None),
    "logit_bias": ([lambda: _greedy(logit_bias={5: 2.0})], {}, None),
    "allowed_token_ids": ([lambda: _greedy(allowed_token_ids=[1, 2, 3])], {}, None),
    "bad words": ([_bad_words], {}, None),
    "structured output": ([_greedy], dict(structured=True), None),
    "NaN counting": ([_greedy], dict(nan_check=True), None),
    "logprobs=5": ([lambda: _greedy(logprobs=5), _greedy], {}, "logprobs"),
    "logprobs=0": ([lambda: _greedy(logprobs=0)], {}, "logprobs"),
    "logprobs=20": ([lambda: _greedy(logprobs=20)], {}, "logprobs"),
    "logprobs=21": ([lambda: _greedy(logprobs=21)], {}, None),
    "logprobs=-1 (whole vocab)": ([lambda: _greedy(logprobs=-1)], {}, None),
    "logprobs=20, vocab < 1280": ([lambda: _greedy(logprobs=20)], dict(vocab=1000), None),
    "logprobs, raw_logits mode": ([lambda: _greedy(logprobs=2)],
                                  dict(logprobs_mode="raw_logits"), None),
    "logprobs, spec decode": ([lambda: _greedy(logprobs=2)], dict(spec=True, verify="standard"),
                              None),
}


@pytest.mark.parametrize("name", list(DECISIONS))
def test_decision_per_sampling_parameter(name):
    from commfold.vllm.target.decision import decide

    makers, kw, want = DECISIONS[name]
    vocab = kw.pop("vocab", V)
    md = _metadata_for([m() for m in makers], vocab)
    kw = dict(dict(spec=False, structured=False, logprobs_mode="raw_logprobs"), **kw)
    mode, reason = decide(md, vocab=vocab, **kw)
    assert mode == want, (name, reason)
    assert reason


def test_custom_logits_processor_keeps_vllms_path():
    from vllm.v1.sample.logits_processor import LogitsProcessor

    from commfold.vllm.target.decision import decide

    class Custom(LogitsProcessor):
        def __init__(self, *a, **kw):
            pass

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            pass

        def apply(self, logits):
            return logits

    md = _metadata_for([_greedy()], custom=[Custom])
    assert decide(md, spec=False, structured=False, logprobs_mode="raw_logprobs",
                  vocab=V) == (None, "logits processors: Custom")


def test_verification_method_from_vllms_own_config_and_sampler():
    """Every rejection_sample_method this vLLM defines, and adaptive verification, set
    on its SpeculativeConfig with the RejectionSampler built from it, through the
    hook's own decision: only "standard" is verified locally (test_vllm_decision.py
    has the method tables of each release)."""
    from types import SimpleNamespace
    from typing import get_args

    from vllm.config import SpeculativeConfig
    from vllm.config.speculative import RejectionSampleMethod
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from commfold.vllm.target.target_pick import Picker

    cases = [(m, {}) for m in get_args(RejectionSampleMethod)] + \
        [("standard", dict(enable_adaptive_verification=True))]
    seen = {}
    for method, extra in cases:
        if method == "synthetic":
            extra = dict(synthetic_acceptance_length=1.5)
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                   prompt_lookup_max=2, prompt_lookup_min=1,
                                   rejection_sample_method=method, **extra)
        sampler = Sampler()
        picker = Picker.__new__(Picker)  # only what _decide reads
        picker.vocab = V
        picker.runner = SimpleNamespace(
            input_batch=SimpleNamespace(sampling_metadata=_metadata_for([_greedy()])),
            sampler=sampler, speculative_config=config,
            rejection_sampler=RejectionSampler(sampler, config))
        picker.scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens={"r0": [1]},
                                                  has_structured_output_requests=False)
        seen["adaptive" if extra.get("enable_adaptive_verification") else method] = \
            picker._decide()
    assert seen.pop("standard") == ("verify", "all greedy")
    assert {"synthetic", "adaptive"} <= set(seen)
    for method, (mode, reason) in seen.items():
        assert mode is None and reason.startswith(f"verification method {method}:"), method


# --- the hook points -------------------------------------------------------------------

def test_hook_points_present_in_this_vllm():
    from commfold.vllm.target.target_pick import hook_points_missing

    assert hook_points_missing() == []


V1 = Runner(1, "the test's choice")  # whatever the environment says


def test_moved_hook_point_leaves_the_hook_off(monkeypatch, caplog):
    from commfold.vllm.target import target_pick as vtp

    moved = vtp.HOOK_POINTS + (("vllm.v1.sample.sampler:Sampler.forward", "not in vLLM"),
                               ("vllm.v1.sample.sampler:NoSuchClass", "x"))
    monkeypatch.setattr(vtp, "HOOK_POINTS", moved)
    vtp.uninstall()
    with caplog.at_level("WARNING", logger="commfold"):
        assert vtp.install(runner=V1) is False
    (line,) = [r.getMessage() for r in caplog.records if "target pick off" in r.getMessage()]
    assert "Sampler.forward: not in vLLM" in line and "NoSuchClass (AttributeError)" in line
    assert "moved what it hooks" in line
    from commfold.vllm.compat.hook_points import wrapped_by
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert wrapped_by(GPUModelRunner.execute_model) == []


def test_off_switch(monkeypatch):
    from commfold.vllm.target import target_pick as vtp

    vtp.uninstall()
    assert vtp.install({"COMMFOLD_TARGET_PICK": "0"}, runner=V1) is False
    assert vtp.enabled({}) and not vtp.enabled({"COMMFOLD_TARGET_PICK": "0"})


# --- the collective log (commfold.distributed.comm_log, commfold.vllm.observe.step_log) -----------
# It sees what really runs in a vLLM TP=2 group: vLLM CPU's shared-memory ops (which
# never reach a c10d backend), its gloo fallback, and commfold's own ops on either -
# each collective once, with this rank's shapes, dtype and bytes; the engine-step
# recorder writes one line per step with each collective's phase (outermost phase
# wins: a LogitsProcessor call inside drafting is drafting), read back by
# read_step_logs. (In this module to share its rank pool; the engine runs are
# test_vllm_spec_decode.py's and, opt-in, test_vllm_engine.py's.)

def _seen(shm: bool, log_dir: str):
    from types import SimpleNamespace

    from commfold.vllm.observe import step_log as vllm_comm_log
    from commfold.ops.local_argmax import local_argmax
    from commfold.distributed.comm_log import record_collectives
    from harness.vllm_tp import shm_handle

    tp = init_vllm_tp(2, shm=shm, reuse=True)
    comm = f"vllm_shm:{shm_handle(tp)}" if shm else f"vllm:{tp.unique_name}"
    x = torch.randn(4, 10)
    with record_collectives() as log:
        tp.all_gather(x, dim=-1)
        tp.all_reduce(x.clone())
        local_argmax(x, 19, comm)  # one gather of a (value, index) int64 pair per row
        tp.gather(x.to(torch.bfloat16), dst=0, dim=-1)
    torch.distributed.barrier()  # vLLM's shm gather does not wait on senders (vllm_tp)
    events = [(e.name, e.shapes, e.dtype, e.bytes) for e in log.events]

    # the step recorder, driven as the runner wrappers drive it
    rec = vllm_comm_log._recorder = vllm_comm_log._StepRecorder(log_dir)
    try:
        for step in range(2):
            rec.begin(SimpleNamespace(total_num_scheduled_tokens=7 + step,
                                      num_scheduled_tokens={"a": 4, "b": 3 + step},
                                      scheduled_spec_decode_tokens={"a": [1, 2]}))
            with vllm_comm_log.phase("forward"):
                tp.all_reduce(x.clone())
            with vllm_comm_log.phase("logits"):
                tp.all_gather(x, dim=-1)
            vllm_comm_log.note("target_pick", f"note {step}")
            tp.all_reduce(x[:1].clone())  # outside every phase: "other"
            with vllm_comm_log.phase("drafting"):
                with vllm_comm_log.phase("logits"):
                    local_argmax(x, 19, comm)
            rec.end()
        rec.end()  # no open step: nothing written
    finally:
        vllm_comm_log._recorder = None
    return {"events": events, "rank": tp.rank_in_group}


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_collectives_seen_once_with_phases(vllm_ranks, shm, tmp_path):
    if shm and not shm_supported():
        pytest.skip("vLLM's kernel build for this CPU (AVX2) has no shared-memory communicator")
    _check_collectives_seen(vllm_ranks.run(_seen, shm, str(tmp_path)), shm, tmp_path)


def test_pick_equals_vllms_sampler_gloo(vllm_ranks):
    """vLLM's torch.distributed fallback (last: the groups are made once per kind)."""
    if not shm_supported():
        pytest.skip("test_pick_equals_vllms_sampler ran on gloo already (no shm here)")
    _check(vllm_ranks.run(_run_cases, False, CASES[3:5] + CASES[9:10]))


def _check_collectives_seen(results, shm, tmp_path):
    from commfold.distributed.comm_log import read_step_logs

    # shm sends non-float data bit-cast as float32: an int64 pair is 4 float32
    pair = ((4, 4), "float") if shm else ((4, 2), "long int")
    for res in results:
        assert res["events"] == [("all_gather", ((4, 10),), "float", 160),
                                 ("all_reduce", ((4, 10),), "float", 160),
                                 ("all_gather", (pair[0],), pair[1], 64),
                                 ("gather", ((4, 10),), "c10::BFloat16", 80)], res

    logs = read_step_logs(tmp_path)
    assert sorted(logs) == [0, 1]
    for rank, steps in logs.items():
        assert [s.step for s in steps] == [0, 1]
        for s in steps:
            assert s.rank == rank
            assert s.info["tokens"] == 7 + s.step and s.info["requests"] == 2
            assert s.info["spec_tokens"] == 2 and s.info["target_pick"] == f"note {s.step}"
            assert [(e.name, e.phase) for e in s.events] == [
                ("all_reduce", "forward"), ("all_gather", "logits"),
                ("all_reduce", "other"), ("all_gather", "drafting")], s.events
            assert s.in_phase("logits").vocab_gathers(10) == s.of("all_gather")[:1]
            assert s.in_phase("drafting").vocab_gathers(10) == []  # the pair exchange
            assert s.in_phase("drafting").bytes() == 64


def _by_cost_rule(shm):
    """Steps of a tiny vocabulary with the pick's cost rule on, as users get it."""
    from vllm.platforms import current_platform

    from harness import vllm_step as tc
    from harness.vllm_tp import init_vllm_tp

    current_platform.register_triton_kernel_overrides()
    init_vllm_tp(2, shm=shm, reuse=True)
    out = {}
    for k in (None, 5):
        model = tc.TinyLM(V, torch.float32, 0, False)
        h = tc.hidden(2, torch.float32, 1, False)
        res = tc.step_both_ways(model, tc.metadata(2, k, V), h, cost_rule=True)
        out[k] = (res["mode"], res["ours_log"].calls(), tuple(res["shard"]))
    return out


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_cost_rule_leaves_small_logprobs_steps_to_vllm(vllm_ranks, shm):
    """With the cost rule on, a 2-row logprobs=5 step over a tiny vocab (two exchanges
    measured slower than vLLM's gather there) runs vLLM's path: the full row comes
    back, one gather; the greedy step (one exchange, never measured slower on the CPU
    communicators) is still picked locally."""
    if shm and not shm_supported():
        pytest.skip("no vLLM shared-memory communicator on this CPU")
    for res in vllm_ranks.run(_by_cost_rule, shm):
        mode, calls, shape = res[None]
        assert mode == "greedy" and calls == 1 and shape[-1] < V, res
        mode, calls, shape = res[5]
        assert mode is None and calls == 1 and shape[-1] >= V, res
