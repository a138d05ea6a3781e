"""Speculative decoding on vLLM's real engine at TP=2 with commfold in the drafter:
``draft_model`` and ``eagle3`` (a draft vocab smaller than the target's: the d2t
remap), commfold off vs on (the plugin, COMMFOLD_VLLM=1).

The engine runs are tools/vllm_spec_check.py's (one command, off and on engines
per method in one process), started in the
background by the vLLM group's first test (conftest), so its engine starts overlap
the group's rank tests: it checks everything itself and exits 1 otherwise. Here the
same artifacts are read again and each property asserted on its own, so a failure
names it: identical greedy tokens, identical acceptance per draft position (and both
accepted and rejected drafts), each rank's drafter graph
with its all-reduce + RMSNorm fusions (the final norm's included) and its embedding
replicated, the same decisions on both ranks, the draft pick compiled with
local_argmax, and, in every engine step's collective log, full-vocab gathers in the
drafting phase without commfold and none with it.

Engine starts (~50 s each on 2 cores) are the suite's dearest seconds: the default run
has ``draft_model`` (two engines); ``-m slow`` adds ``eagle3`` (two more: the run's
methods are those of the selected tests). EAGLE-3's own pick - the draft vocab's local
argmax, then the d2t remap - is tested in every run on ranks against vLLM's real Eagle3
compute_logits (test_vllm_draft_pick.py).
"""
from __future__ import annotations

import json

import pytest

from harness.vllm_models import require_vllm_installed

pytestmark = [*require_vllm_installed(), pytest.mark.engine]

from commfold.distributed.comm_log import read_step_logs  # noqa: E402
from commfold.vllm.observe.step_checks import target_pick_problems  # noqa: E402
from harness.vllm_spec import (drafting_gathers, is_final_norm,  # noqa: E402
                                        rank_reports, split_reports)

# harness.vllm_models.SPEC_METHODS, eagle3 opt-in (conftest's spec_decode_run runs the
# methods of the selected tests)
METHODS = ["draft_model", pytest.param("eagle3", marks=pytest.mark.slow)]
WIDE_ROW = 1024


@pytest.fixture(scope="module")
def spec_run(spec_decode_run):
    done = spec_decode_run.wait()  # started early by conftest, or here
    out = spec_decode_run.out
    assert (out / "results.json").is_file(), done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    return {"out": out, "done": done, "results": results}


def test_example_checks_hold(spec_run):
    done = spec_run["done"]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "checks hold" in done.stdout and "FAILED" not in done.stdout


@pytest.mark.parametrize("method", METHODS)
def test_tokens_and_acceptance_identical(spec_run, method):
    off, on = (spec_run["results"][method][v] for v in ("off", "commfold"))
    assert on["tokens"] == off["tokens"]
    assert all(len(t) == 24 for t in on["tokens"])
    assert on["acceptance"] == off["acceptance"]
    acc = off["acceptance"]
    assert len(acc["per_pos"]) == 3 and sum(acc["per_pos"]) == acc["accepted"]
    assert 0 < acc["accepted"] < acc["draft_tokens"], acc  # accepted and rejected


@pytest.mark.parametrize("method", METHODS)
def test_drafter_rewritten_on_every_rank(spec_run, method):
    out = spec_run["out"] / method
    assert rank_reports(out / "off") == {}  # commfold off really is off
    reports = rank_reports(out / "commfold")
    assert sorted(reports) == [0, 1]
    graphs = {rank: split_reports(reps) for rank, reps in reports.items()}
    assert [g.fingerprint() for g in graphs[0]["model"]] == \
        [g.fingerprint() for g in graphs[1]["model"]]
    for gs in graphs.values():
        target, drafter = gs["model"]  # vLLM compiles the target first
        for g in (target, drafter):
            assert not g.errors and not g.from_cache, g.summary()
        # the target (2 layers, its embedding replicated): 2 fusions a layer, less the
        # one whose reduced value EAGLE-3 also reads (vLLM's aux hidden states)
        fused = [r for r in target.rewrites if r.pass_name == "fuse_allreduce_rmsnorm"]
        aux = [m for m in target.near_misses if m.pass_name == "fuse_allreduce_rmsnorm"]
        assert len(fused) + len(aux) == 4 and sum(map(is_final_norm, fused)) == 1, \
            target.summary()
        assert len(aux) == (method == "eagle3"), target.summary()
        assert all("read besides" in m.reason for m in aux), target.summary()
        assert target.count("replicate_vocab_parallel", "vocab_parallel_embedding") == 1
        fused = [r for r in drafter.rewrites if r.pass_name == "fuse_allreduce_rmsnorm"]
        # one layer: o_proj's all-reduce into the post-attention norm, down_proj's
        # into the final norm (the embedding's all-reduce is gone: replicated)
        assert len(fused) == 2 and sum(map(is_final_norm, fused)) == 1, drafter.summary()
        assert all(r.detail.startswith("bfloat16, +residual") for r in fused), drafter.summary()
        (emb,) = [r for r in drafter.rewrites if r.pass_name == "replicate_vocab_parallel"]
        assert emb.pattern == "vocab_parallel_embedding" and emb.comm_after.calls == 0
        text = drafter.summary()
        assert "fuse_allreduce_rmsnorm" in text and "replicate_vocab_parallel" in text
        assert gs["picks"] and all(p.count("local_argmax") == 1 for p in gs["picks"]), \
            [p.summary() for p in gs["picks"]]


def _sent(step):
    return [e for e in step.events if e.phase != "compile"]


@pytest.mark.parametrize("method", METHODS)
def test_no_full_vocab_gather_while_drafting(spec_run, method):
    out = spec_run["out"] / method
    for variant, expect_full in (("off", True), ("commfold", False)):
        logs = read_step_logs(out / variant / "comm-log")
        assert sorted(logs) == [0, 1], variant
        # the same collectives on both ranks (a pick compiling during a step traces its
        # gather on fake tensors: phase "compile", nothing sent, not compared)
        assert [_sent(s) for s in logs[0]] == [_sent(s) for s in logs[1]], variant
        d = drafting_gathers(logs[0], WIDE_ROW)
        assert d["steps"] > 0, d
        if expect_full:  # vLLM's pick: a gather of logits rows per draft token
            assert d["vocab_gathers"] >= d["steps"], d
        else:  # commfold's: one (value, index) pair per row per rank
            assert d["vocab_gathers"] == 0 and d["gathers"] > 0 and d["row_bytes"] == 16, d


@pytest.mark.parametrize("method", METHODS)
def test_target_verify_picked_locally(spec_run, method):
    """The target pick under speculative decoding: with commfold every verify step is the target's
    local argmax at each draft position (no vocab-wide gather of its logits), then
    vLLM's accept/reject (identical acceptance: above); without commfold each verify
    step gathers the target's logits rows."""
    out = spec_run["out"] / method
    on, off = (read_step_logs(out / v / "comm-log") for v in ("commfold", "off"))
    assert target_pick_problems(on, WIDE_ROW) == []
    verify = [s for s in on[0] if s.info.get("spec_tokens")]
    assert verify and all(s.info["target_pick"] == "verify" for s in verify)
    assert not any("target_pick" in s.info for s in off[0])
    off_verify = [s for s in off[0] if s.info.get("spec_tokens")]
    assert off_verify  # (how requests share steps depends on their arrival: not compared)
    for s in off_verify:  # vLLM's: one gather of [draft positions + bonus rows, shard]
        (gather,) = s.in_phase("logits").vocab_gathers(WIDE_ROW)
        assert gather.shapes[0][0] == s.info["requests"] + s.info["spec_tokens"], s
