"""vLLM's multi-module MTP speculative decoding on its engine, Model Runner V2's CPU
runner (harness.triton_cpu's V2 recipe), TP=2: a tiny DeepSeek-V3 with two MTP layers
and num_speculative_tokens=2, so vLLM builds its ``MultiModuleMTPSpeculator``
(harness/vllm_mtp2.py). vLLM alone, then commfold on through the plugin
(COMMFOLD_VLLM=1) without and with use_local_argmax_reduction (which vLLM alone
refuses: DeepSeek's MTP drafter has no get_top_tokens; commfold installs one taking
vLLM's ``spec_step_idx``): the engines start (no TypeError), greedy tokens and
vLLM's spec-decode counters equal vLLM's, no vocab-wide gather in any served step
with commfold on (vLLM's run gathers the draft logits), and each worker says whose
pick the speculator runs.

Opt-in (three engines, minutes each on 2 cores): `slow`, run with
`python -m pytest -m slow tests/test_vllm_mtp2_engine.py`."""
from __future__ import annotations


import pytest

from harness.vllm_models import require_vllm_installed

from commfold.distributed.comm_log import CommLog
from harness.vllm_engine import engine_runs
from harness.vllm_mtp2 import VOCAB

pytestmark = [*require_vllm_installed(group="module"), pytest.mark.engine, pytest.mark.slow]

RUNS = {"vllm": ("", False), "commfold": ("1", False), "commfold-local-argmax": ("1", True)}
SHARD = 512  # the vocab rows a rank holds (1000 padded to 1024 at TP=2)


@pytest.fixture(scope="module")
def mtp2_runs(tmp_path_factory):
    got = engine_runs("harness.vllm_mtp2", tmp_path_factory.mktemp("mtp2"),
                      {name: {"COMMFOLD_VLLM": on, "local_argmax": local}
                       for name, (on, local) in RUNS.items()})
    return dict(got, lines=[(x.split(" ", 1)[0], x.split("commfold: ", 1)[1])
                       for x in got["printed"]
                       if "commfold: MultiModuleMTPSpeculator" in x
                       and x.startswith("(Worker_TP")])  # through vLLM's handlers


def test_mtp2_tokens_equal_vllms(mtp2_runs):
    out = mtp2_runs["out"]
    assert not any("TypeError" in x for x in mtp2_runs["printed"])
    assert all(len(t) == 10 for t in out["vllm"]["tokens"])
    assert out["vllm"]["spec"]["num_draft_tokens"] > 0, out["vllm"]["spec"]
    for name in ("commfold", "commfold-local-argmax"):
        assert out[name]["tokens"] == out["vllm"]["tokens"], name
        assert out[name]["spec"] == out["vllm"]["spec"], name  # the same drafts accepted


def test_mtp2_each_worker_names_the_pick(mtp2_runs):
    """One line per worker and engine with commfold on (printed as vLLM prints its
    own lines, "(Worker_TP0 pid=...) INFO ... commfold: ...")."""
    lines = sorted((worker.split("_TP")[-1], line) for worker, line in mtp2_runs["lines"])
    assert lines == sorted((rank, line) for rank in ("0", "1") for line in (
        "MultiModuleMTPSpeculator's greedy draft tokens are commfold's pick",
        "MultiModuleMTPSpeculator drafts with use_local_argmax_reduction: vLLM's "
        "get_draft_top_tokens picks, with the drafter's get_top_tokens (commfold's: "
        "it had none)")), mtp2_runs["lines"]


def test_mtp2_no_vocab_gather_with_commfold(mtp2_runs):
    def wide(step) -> list:  # vocab-wide gathers that really ran (not traced)
        return CommLog([e for e in step.events if e.phase != "compile"]).vocab_gathers(SHARD)

    for name in RUNS:
        by_rank = mtp2_runs["steps"][name]
        assert sorted(by_rank) == [0, 1], name
        assert [s.events for s in by_rank[0]] == [s.events for s in by_rank[1]], name
        served = [s for s in by_rank[0] if s.info["tokens"] and s.step > 0]
        assert served, name
        # step 0, the engine's warm-up: V2's dummy sampler run gathers the logits (a
        # LogitsProcessor call: phase "logits"), no hook involved, in every run
        assert {e.phase for e in wide(by_rank[0][0])} == {"logits"}, (name, by_rank[0][0])
        gathers = [(s.step, e.phase, e.shapes) for s in served for e in wide(s)]
        if name == "vllm":  # the draft logits gathered: what commfold removes
            assert len(gathers) > len(served), gathers
        else:
            assert gathers == [], (name, gathers)
    assert VOCAB > SHARD
