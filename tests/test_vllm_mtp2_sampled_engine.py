"""Probabilistic drafting by vLLM's multi-module MTP speculator (a drafter module per
MTP layer, ``spec_step_idx`` choosing it; vLLM shares the target's LM head into
every layer) on Model Runner V2's CPU engine, TP=2 (harness/vllm_mtp2.py: a tiny
DeepSeek-V3 with two MTP layers, dummy weights), serving seeded sampled requests
(temperature 0.8, a repetition penalty). vLLM alone, then commfold on through the
plugin: tokens and vLLM's spec-decode counters equal vLLM's; with commfold every
served step draws its drafts from the head's shard and verifies from the target's,
with no vocab-wide gather. This
vocab (1000) is too small for the shards to send fewer bytes than vLLM's gather (the
cost rule, off in these engines, would leave it to vLLM): it tests exactness. With
vLLM's dummy weights the drafter's and the target's distributions nearly agree and
every draft is accepted: rejections and resampling are tests/test_vllm_draft_sampled_
engine.py's (seeded weights) and the ranks tests'.

Opt-in (two engines, minutes each on 2 cores): `slow`, run with
`python -m pytest -m slow tests/test_vllm_mtp2_sampled_engine.py`."""
from __future__ import annotations

import pytest

from harness.vllm_engine import engine_runs
from harness.vllm_models import require_vllm_installed

pytestmark = [*require_vllm_installed(group="module"), pytest.mark.engine, pytest.mark.slow]

RUNS = {"vllm": "", "commfold": "1"}
SHARD = 512  # the vocab rows a rank holds (1000 padded to 1024 at TP=2)


@pytest.fixture(scope="module")
def sampled_runs(tmp_path_factory):
    return engine_runs("harness.vllm_mtp2", tmp_path_factory.mktemp("mtp2s"),
                       {name: {"COMMFOLD_VLLM": on, "sampled": True}
                        for name, on in RUNS.items()})


def test_mtp_sampled_tokens_equal_vllms(sampled_runs):
    out = sampled_runs["out"]
    assert all(len(t) == 10 for t in out["vllm"]["tokens"])
    assert out["vllm"]["spec"]["num_draft_tokens"] > 0, out["vllm"]["spec"]
    assert out["commfold"]["tokens"] == out["vllm"]["tokens"]
    assert out["commfold"]["spec"] == out["vllm"]["spec"]


def test_mtp_drafts_and_verification_from_the_shards(sampled_runs):
    by_rank = sampled_runs["steps"]["commfold"]
    assert sorted(by_rank) == [0, 1]
    r0, r1 = by_rank[0], by_rank[1]
    n = min(len(r0), len(r1))  # the engine's shutdown can cut a worker's last lines
    assert [s.info for s in r0[:n]] == [s.info for s in r1[:n]]
    served = [s for s in r0 if s.info["tokens"] and s.step > 0]
    assert served
    assert {s.info.get("draft_pick") for s in served} == {"sampled"}, served
    picks = {s.info.get("target_pick") for s in served}
    assert picks <= {"sample", "verify_sampled"} and "verify_sampled" in picks, picks
    for s in served:
        assert s.vocab_gathers(SHARD) == [], s
