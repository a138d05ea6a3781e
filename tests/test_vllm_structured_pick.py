"""Structured output on Model Runner V2 from the shards (commfold.vllm.sample.shard_grammar):
a step with a grammar bitmask through V2's own ``GPUModelRunner.sample`` (its
StructuredOutputsWorker masking the full row, then its Sampler) and through commfold's
hook (V2's worker masking each rank's shard with the bitmask re-packed for it, then
the local pick or draw), on 2 gloo ranks (4 under -m slow: shards starting inside a
32-token word): the same tokens bit for bit, the same logprobs ids, the pick's usual
collectives and no vocab-wide gather. Bitmasks at random, rows masked whole, rows
allowing one shard or three tokens, bits past the vocab set, min_tokens on structured
requests (V2 restores the stop tokens of a row masked whole: one all-gather of the row
maxima); under spec decoding V2's verification of the masked rows (a grammar's
invalid drafts rejected).
V2's grammar kernel runs in Triton's interpreter with harness.triton_cpu's int1
comparisons (without them V2's own run fails)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed(group="module")

V = 1500  # padded to 1536: rank 1 holds 732 real columns + 36 padding
V4 = 1050  # at TP=4 shards of 272 columns: the bitmask re-packed across words
NOTE = "bitmask on the shard"
# collectives per mode: the pair; logprobs' two; V2's verification of sampled drafts
# (the split block's columns, the block stats, the resampled pair: vocab 1500)
BASE = {"greedy": 1, "logprobs": 2, "sample": 1, "sample_logprobs": 3, "verify": 1,
        "verify_sampled": 3}


def _check(results):
    from harness.vllm_step_v2 import score_ulps, steps_as_v2s

    for r, case, where in steps_as_v2s(results):
        mode, gathers = case["mode"], r["ours_gathers"]
        if mode in BASE:
            assert sorted(r["notes"]) == sorted([mode, NOTE]), (where, r["notes"])
            assert gathers <= 1 if case.get("whole") is None else gathers == 0, where
            min_p = mode.startswith(("sample", "verify_sampled")) and any(
                p.get("min_p") and p.get("temperature", 1.0) for p in _rows(case))
            # the row maxima for V2's stop-token restore (a structured request's
            # min_tokens)
            restore = any(p.get("min_tokens") and p.get("structured_outputs")
                          for p in _rows(case))
            assert r["calls"] == BASE[mode] + min_p + restore + gathers, (
                where, r["calls"])
            assert all(r["ours"][i][0] in STOPS for i in case.get("restored", ())), \
                (where, r["ours"])
        else:  # vLLM's path, the note saying why
            assert r["notes"][-1].startswith("vLLM ("), (where, r["notes"])
            assert mode in r["notes"][-1], (where, r["notes"])
            assert gathers == 1, where
        ours, theirs = r["logprobs"], r["vllm_logprobs"]
        assert (ours is None) == (theirs is None), where
        if ours is not None:  # ids and dtype; the scored token's rank V2's, where
            # Triton's interpreter counts right (float32: bf16 lanes miscount)
            assert ours[0] == theirs[0] and ours[2] == theirs[2], where
            assert case["dtype"] != "float32" or ours[1] == theirs[1], where
            assert r["score_diff"] <= score_ulps(case), (where, r["score_diff"])


def _rows(case) -> list[dict]:
    return case.get("row_params") or [case.get("params", {})]


T = dict(temperature=0.8, seed=7)
JSON = dict(json={"type": "integer"})
STOPS = [5, V // 2 + 1, V - 1]  # the tokens of harness.vllm_step_v2's "few" rows
CASES = [
    # greedy: bits at random, a row masked whole, a row allowing one shard only
    dict(vocab=V, dtype="float32", seed=1, ties=True, rows=3, mode="greedy",
         grammar=dict(reqs=[0, 1, 2], rows=["random", "none", "low"], density=0.3)),
    dict(vocab=V, dtype="bfloat16", seed=2, ties=False, rows=4, mode="greedy",
         grammar=dict(reqs=[3, 1], rows=["few", "random"], density=0.02)),
    # sampled: some requests structured, min_p (its row maxima exchange), penalties
    dict(vocab=V, dtype="float32", seed=3, ties=False, rows=3, mode="sample", params=T,
         grammar=dict(reqs=[0, 2], rows=["random", "few"], density=0.1)),
    dict(vocab=V, dtype="bfloat16", seed=4, ties=True, rows=3, mode="sample", history=10,
         row_params=[dict(temperature=0.7, seed=1, min_p=0.05),
                     dict(temperature=0.0, repetition_penalty=1.5),
                     dict(temperature=1.2, presence_penalty=0.5)],
         grammar=dict(reqs=[2, 0, 1], rows=["low", "none", "random"], density=0.5)),
    # logprobs of greedy and sampled structured steps (masked columns score -inf)
    dict(vocab=V, dtype="float32", seed=5, ties=True, rows=2, mode="logprobs",
         params=dict(temperature=0.0, logprobs=3), whole=None,
         grammar=dict(reqs=[0, 1], rows=["random", "all"], density=0.4)),
    dict(vocab=V, dtype="float32", seed=6, ties=False, rows=2, mode="sample_logprobs",
         params=dict(temperature=0.9, seed=3, logprobs=2), whole=None,
         logprobs_mode="processed_logprobs",
         grammar=dict(reqs=[1], rows=["random"], density=0.2)),
    # a NaN column the grammar allows: gathered (masked) and given to V2
    dict(vocab=V, dtype="float32", seed=7, ties=True, rows=2, mode="NaN", params=T,
         nan_column=5, grammar=dict(reqs=[0, 1], rows=["all", "few"])),
    # min_tokens on structured requests: V2 masks the stop tokens, then restores them
    # where the whole row is -inf ("few": the grammar allows only the stop tokens, on
    # both shards; "none": nothing to restore; "random": the row keeps other tokens)
    dict(vocab=V, dtype="float32", seed=8, ties=True, rows=3, mode="sample",
         row_params=[dict(temperature=0.8, seed=2, min_tokens=4, stop_token_ids=STOPS,
                          structured_outputs=JSON),
                     dict(temperature=0.0),
                     dict(temperature=1.0, seed=3, min_tokens=4, stop_token_ids=[5, 900],
                          structured_outputs=JSON)],
         grammar=dict(reqs=[0, 2], rows=["few", "random"], density=0.3),
         restored=[0]),  # rows whose token is a restored stop token
    dict(vocab=V, dtype="bfloat16", seed=10, ties=False, rows=3, mode="sample",
         row_params=[dict(temperature=0.0, min_tokens=3, stop_token_ids=STOPS,
                          structured_outputs=JSON, logit_bias={751: 3.0}),
                     dict(temperature=0.0, min_tokens=3, stop_token_ids=STOPS,
                          structured_outputs=JSON),
                     dict(temperature=0.5, seed=4, min_tokens=1, stop_token_ids=STOPS,
                          structured_outputs=JSON)],
         grammar=dict(reqs=[0, 1, 2], rows=["few", "none", "few"]), restored=[0]),
    # under spec decoding: every draft position's row masked; up to vLLM 0.33 the
    # drafts past a request's acceptable ones verified as -1 (rejected)
    dict(vocab=V, dtype="bfloat16", seed=9, ties=True, drafts=[[1, 2], [3]], accept=True,
         mode="verify", grammar=dict(reqs=[0, 1], rows=["random", "all"], density=0.9,
                                     acceptable=[1, 1])),
    dict(vocab=V, dtype="float32", seed=13, ties=False, drafts=[[1, 2], [3, 4, 5]],
         accept=True, mode="verify_sampled", params=T,
         grammar=dict(reqs=[1, 0], rows=["all", "random", "few"], density=0.6,
                      acceptable=[3, 0])),
    dict(vocab=V, dtype="bfloat16", seed=14, ties=True, drafts=[[1, 2, 3]], accept=True,
         mode="verify_sampled", row_params=[dict(temperature=0.6, seed=2, min_p=0.05)],
         grammar=dict(reqs=[0], rows=["all"], acceptable=[2])),
]


def test_structured_steps_equal_v2s(vllm_v2_ranks):
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks.run(step_cases, 2, CASES))


def _model_state() -> bool:
    from commfold.vllm.compat import releases

    return releases.here().at_least("0.34.0")


STATE_CASES = [  # a bitmask reaching a shard of a batch not decided as structured
    dict(vocab=V, dtype="float32", seed=11, ties=True, rows=3, mode="greedy", unmarked=True,
         grammar=dict(reqs=[0, 2], rows=["random", "none"], density=0.3)),
    dict(vocab=V, dtype="float32", seed=12, ties=True, drafts=[[1, 2], [3]], accept=True,
         mode="verify", unmarked=True,
         grammar=dict(reqs=[1], rows=["random"], density=0.5)),
]


@pytest.mark.skipif("not _model_state()", reason="vLLM 0.34's model-state hooks")
def test_state_hook_masks_a_batch_it_did_not_know_structured(vllm_v2_ranks):
    """vLLM 0.34: decided before the bitmask exists, from has_structured_output_reqs;
    a bitmask for a batch decided otherwise still masks the shard (the step decided
    again with it: taken, spec decoding included)."""
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks.run(step_cases, 2, STATE_CASES))


CASES4 = [
    dict(vocab=V4, dtype="float32", seed=21, ties=True, rows=3, mode="sample", params=T,
         grammar=dict(reqs=[0, 1, 2], rows=["random", "few", "low"], density=0.05)),
    dict(vocab=V4, dtype="bfloat16", seed=22, ties=False, rows=2, mode="greedy",
         grammar=dict(reqs=[1, 0], rows=["random", "none"], density=0.5)),
]


@pytest.mark.slow
def test_structured_steps_on_4_ranks(vllm_v2_ranks4):
    """Opt-in (-m slow): shards starting inside a 32-token word."""
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks4.run(step_cases, 4, CASES4))


ROW = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.0, 0.5, 1.0]),
    "seed": st.one_of(st.none(), st.integers(0, 2**30)),
    "min_p": st.sampled_from([0.0, 0.0, 0.1]),
    "logprobs": st.sampled_from([None, None, 2]),
})
KINDS = st.sampled_from(["random", "random", "none", "low", "few", "all"])


def _example(vocab, dtype, rows, ties, seed, kinds, density, structured):
    reqs = [i for i, on in enumerate(structured[:len(rows)]) if on] or [0]
    sampled = any(p["temperature"] != 0.0 for p in rows)
    logprobs = any(p["logprobs"] is not None for p in rows)
    mode = ("sample_logprobs" if logprobs else "sample") if sampled else \
        ("logprobs" if logprobs else "greedy")
    return dict(vocab=vocab, dtype=dtype, seed=seed, ties=ties, rows=len(rows),
                row_params=rows, mode=mode, whole=None,
                grammar=dict(reqs=reqs, rows=kinds, density=density))


EXAMPLE = dict(
    vocab=st.integers(1030, 1700), dtype=st.sampled_from(["float32", "bfloat16"]),
    rows=st.lists(ROW, min_size=1, max_size=4), ties=st.booleans(),
    seed=st.integers(0, 2**16), kinds=st.lists(KINDS, min_size=1, max_size=4),
    density=st.sampled_from([0.01, 0.3, 0.9]),
    structured=st.lists(st.booleans(), min_size=4, max_size=4))


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**EXAMPLE)
def test_structured_examples(vllm_v2_ranks, **example):
    """Random bitmasks (densities, rows masked whole, one shard, a few tokens), odd
    vocab sizes (bits past the vocab set), greedy and sampled rows, min_p, logprobs."""
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks.run(step_cases, 2, [_example(**example)]))


@pytest.mark.slow
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**EXAMPLE)
def test_structured_examples_on_4_ranks(vllm_v2_ranks4, **example):
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks4.run(step_cases, 4, [_example(**example)]))


def test_the_shard_mask_is_pinned_to_this_vllms_grammar_functions():
    """V2's bitmask method and kernel hash to a source commfold read for this release;
    a moved one keeps structured steps vLLM's with the reason."""
    from commfold.vllm.compat import hook_points
    from commfold.vllm.sample import shard_grammar

    assert hook_points.missing(shard_grammar.POINTS) == []
    assert shard_grammar.refusal() is None


def test_a_changed_grammar_function_keeps_structured_steps_vllms(monkeypatch):
    from types import SimpleNamespace

    from commfold.vllm.sample import shard_grammar
    from commfold.vllm.target import v2_pick
    from commfold.vllm.compat.hook_points import Pinned

    where, _ = shard_grammar.POINTS[1]
    monkeypatch.setattr(shard_grammar, "POINTS", ((where, Pinned((("9.9.9", "0" * 16),))),))
    shard_grammar.refusal.cache_clear()
    monkeypatch.setattr(v2_pick, "decide_v2", lambda step, **kw: ("greedy", "all greedy"))
    monkeypatch.setattr(v2_pick, "step_of", lambda *a, **kw: None)
    batch = SimpleNamespace(num_reqs=1, num_draft_tokens=0)
    try:
        mode, why = v2_pick.decide_step(object(), None, None, batch, structured=True)
        assert mode is None and where in why, why
        assert v2_pick.decide_step(object(), None, None, batch, structured=False)[0] == \
            "greedy"
    finally:
        shard_grammar.refusal.cache_clear()
