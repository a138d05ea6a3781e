"""Probabilistic drafting and sampled verification on vLLM's engine, Model Runner V2's
CPU runner (harness.triton_cpu's V2 recipe), TP=2: a target and its early-exit drafter
with ``draft_sample_method="probabilistic"`` serving seeded sampled requests
(temperature 0.8, a repetition penalty; harness/vllm_draft_engine_v2.py). vLLM alone,
then commfold on through the plugin (COMMFOLD_VLLM=1): tokens and vLLM's spec-decode
counters equal vLLM's (drafts accepted and rejected); with commfold every served step
drafts from the drafter's shard and verifies (or samples) from the target's, no
vocab-wide gather anywhere, and under a tenth of the collective bytes of vLLM's run
outside the forward passes.

Opt-in (two engines, about four minutes on 2 cores): `slow`, run with
`python -m pytest -m slow tests/test_vllm_draft_sampled_engine.py`."""
from __future__ import annotations

import pytest

from harness.vllm_models import require_vllm_installed

from commfold.distributed.comm_log import CommLog
from harness.vllm_draft_engine_v2 import VOCAB
from harness.vllm_engine import engine_runs

pytestmark = [*require_vllm_installed(group="module"), pytest.mark.engine, pytest.mark.slow]

RUNS = {"vllm": "", "commfold": "1"}
SHARD = VOCAB // 2  # the vocab rows a rank holds (32000: no padding at TP=2)


@pytest.fixture(scope="module")
def draft_runs(tmp_path_factory):
    return engine_runs("harness.vllm_draft_engine_v2", tmp_path_factory.mktemp("drafts"),
                       {name: {"COMMFOLD_VLLM": on} for name, on in RUNS.items()})


def _served(by_rank):
    return [s for s in by_rank[0] if s.info["tokens"] and s.step > 0]


def _sent(step) -> int:
    """The bytes of the step's collectives outside the models' forward passes (the
    all-reduces there are the same in both runs)."""
    return CommLog([e for e in step.events if e.phase not in ("forward", "compile")]).bytes()


def test_tokens_and_acceptance_equal_vllms(draft_runs):
    out = draft_runs["out"]
    spec = out["vllm"]["spec"]
    assert all(len(t) == 10 for t in out["vllm"]["tokens"])
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
    assert out["commfold"]["tokens"] == out["vllm"]["tokens"]
    assert out["commfold"]["spec"] == spec  # the same drafts, accepted alike


def test_each_worker_says_the_drafts_are_commfolds(draft_runs):
    """Through vLLM's log handlers, once per worker of the run with commfold on."""
    lines = [x for x in draft_runs["printed"]
             if x.startswith("(VllmWorker") and "commfold: draft pick: probabilistic on" in x]
    assert len(lines) == 2, lines


def test_drafts_and_verification_from_the_shards(draft_runs):
    steps = draft_runs["steps"]
    for name in RUNS:
        by_rank = steps[name]
        assert sorted(by_rank) == [0, 1], name
        # the engine's shutdown can cut a worker's last lines: the steps both logged
        r0, r1 = by_rank[0], by_rank[1]
        n = min(len(r0), len(r1))
        assert n >= len(_served(by_rank)) - 1, name
        assert [s.events for s in r0[:n]] == [s.events for s in r1[:n]], name
        assert [s.info for s in r0[:n]] == [s.info for s in r1[:n]], name
    # the engines may batch the requests' arrival differently: steps need not pair up
    ours, theirs = _served(steps["commfold"]), _served(steps["vllm"])
    picks = [(s.info.get("draft_pick"), s.info.get("target_pick")) for s in ours]
    assert {d for d, _ in picks} == {"sampled"}, picks
    assert {t for _, t in picks} <= {"sample", "verify_sampled"}, picks
    assert sum(t == "verify_sampled" for _, t in picks) >= len(picks) - 1, picks
    for s in ours:
        assert s.vocab_gathers(SHARD) == [], s
    for s in theirs:  # vLLM gathers the target's logits and each draft step's
        assert len(s.vocab_gathers(SHARD)) >= 2, s
    sent = {name: [(s.info["tokens"], _sent(s)) for s in run]
            for name, run in (("commfold", ours), ("vLLM", theirs))}
    print("(tokens, collective bytes) per served step:", sent)
    total = {name: sum(b for _, b in run) for name, run in sent.items()}
    assert total["commfold"] < total["vLLM"] / 10, total
