"""DSpark's greedy draft block with commfold.vllm.spec_decode.dspark_pick: vLLM's own
``DSparkSpeculator._sample_sequential`` (one gather of the block's base draft logits,
then per position the Markov bias and ``argmax``) against the same method under the
hook, on vLLM's real sharded ParallelLMHead + LogitsProcessor and its shipped Markov
head, in a vLLM TP=2 group (gloo, and vLLM's shared memory where this CPU has it):
identical draft tokens over block sizes, request counts, odd vocabularies with
padding, ties across shards, NaN and +-inf logits, a logit scale, a draft-to-target
map; the collectives seen at run time: vLLM's one vocab gather per block, commfold's
one [reqs, 2] pair exchange per position and no vocab gather. Where the block stays
vLLM's (probabilistic drafting, an acceptance estimator, the cost rule) it does, with
its line."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st
import pytest

from harness.vllm_models import init_vllm_tp, require_vllm_installed, shm_supported

pytestmark = require_vllm_installed(group="module")  # Model Runner V2: off the vLLM worker's chain

H, R = 32, 8


def _blocks(shm: bool, cases: list[dict], cost_rule: bool = False) -> list[dict]:
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    from commfold.config import Config
    from commfold.distributed.ranks import environment
    from commfold.vllm.spec_decode import dspark_pick
    from harness.dspark_block import commfold_lines

    init_vllm_tp(2, shm=shm, reuse=True)
    original = DSparkSpeculator.__dict__["_sample_sequential"]
    original = getattr(original, "__wrapped__", original)
    assert dspark_pick.hook(Config(passes=("local_argmax",)), "draft pick")
    with environment({"COMMFOLD_PICK_COST_RULE": "1" if cost_rule else "0"}), \
            commfold_lines() as lines:
        out = [_block(case, original, DSparkSpeculator._sample_sequential)
               for case in cases]
    return [dict(r, lines=lines) for r in out]


def _block(case: dict, original, hooked) -> dict:
    """One case's block, vLLM's own _sample_sequential and the hooked one."""
    import torch

    from harness import dspark_block as db

    dtype = getattr(torch, case["dtype"])
    model = db.drafter(case["vocab"], H, R, dtype, case["seed"], case["ties"],
                       case.get("scale", 1.0), case.get("nan_column"), case.get("d2t", False))
    spec = db.speculator(model, case["reqs"], case["positions"], case["seed"])
    if case.get("estimator"):
        spec.acceptance_estimator = object()  # never reached: vLLM's block runs
        spec._maybe_predict_acceptance = lambda *a: None
    g = torch.Generator().manual_seed(case["seed"] + 1)
    n = case["reqs"] * case["positions"]
    h = torch.randint(-1, 2, (n, H), generator=g).float() if case["ties"] else \
        torch.randn(n, H, generator=g)
    if case.get("special") == "nan":
        h[-1, 3] = float("nan")  # a NaN row of base logits
    if case.get("special") == "inf":
        h[0] = float("inf")  # +-inf and NaN (inf * 0) base logits
    h = h.to(dtype)
    theirs, vllm_events = db.run_block(spec, h, original)
    ours, our_events = db.run_block(spec, h, hooked)
    return dict(case=case, equal=torch.equal(ours, theirs), tokens=ours.tolist(),
                vllm=vllm_events, ours=our_events, shard=model.lm_head.weight.shape[0])


def _check(results: list[list[dict]], local: bool = True) -> None:
    assert results[0] and [[r["tokens"] for r in x] for x in results[1:]] == \
        [[r["tokens"] for r in results[0]]], "ranks disagree"
    for res in results:
        for r in res:
            case, shard = r["case"], r["shard"]
            assert r["equal"], r
            vocab_wide = [e for e in r["vllm"] if any(s and s[-1] == shard for s in e[1])]
            assert [name for name, _ in vocab_wide] == ["all_gather"], r["vllm"]
            if not local:
                assert r["ours"] == r["vllm"], r
                continue
            # one pair exchange per position ([reqs, 2] int64; on vLLM's shared memory
            # as f32 words, [reqs, 4]), nothing vocab-wide
            assert [name for name, _ in r["ours"]] == ["all_gather"] * case["positions"], r
            assert all(shapes[0] in ((case["reqs"], 2), (case["reqs"], 4))
                       for _, shapes in r["ours"]), r["ours"]


CASES = [
    dict(vocab=1000, dtype="float32", seed=1, ties=True, reqs=3, positions=3),
    dict(vocab=1001, dtype="bfloat16", seed=2, ties=True, reqs=1, positions=4),
    dict(vocab=129, dtype="float32", seed=3, ties=False, reqs=2, positions=2, scale=0.5),
    dict(vocab=777, dtype="float32", seed=4, ties=True, reqs=4, positions=3, nan_column=600),
    dict(vocab=777, dtype="bfloat16", seed=5, ties=False, reqs=2, positions=3, special="nan"),
    dict(vocab=500, dtype="float32", seed=6, ties=False, reqs=2, positions=2, special="inf"),
    dict(vocab=640, dtype="float32", seed=7, ties=True, reqs=2, positions=5, d2t=True),
]


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_block_equals_vllms_sample_sequential(vllm_ranks, shm):
    if shm and not shm_supported():
        pytest.skip("vLLM's kernel build for this CPU has no shared-memory communicator")
    _check(vllm_ranks.run(_blocks, shm, CASES))


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vocab=st.integers(65, 1300), dtype=st.sampled_from(["float32", "bfloat16"]),
       reqs=st.integers(1, 5), positions=st.integers(1, 6), ties=st.booleans(),
       seed=st.integers(0, 2**16), special=st.sampled_from([None, "nan", "inf", "column"]))
def test_block_examples_gloo(vllm_ranks, vocab, dtype, reqs, positions, ties, seed, special):
    case = dict(vocab=vocab, dtype=dtype, reqs=reqs, positions=positions, ties=ties,
                seed=seed, special=special)
    if special == "column":
        case["nan_column"] = seed % vocab
    _check(vllm_ranks.run(_blocks, False, [case]))


def test_vllms_block_where_the_full_logits_are_read(vllm_ranks):
    case = dict(vocab=1000, dtype="float32", seed=8, ties=True, reqs=2, positions=3,
                estimator=True)
    results = vllm_ranks.run(_blocks, False, [case])
    _check(results, local=False)
    said = [line for line in results[0][0]["lines"] if "draft block" in line]
    assert any("acceptance estimator" in line for line in said), said


def test_cost_rule_keeps_vllms_gather_for_a_small_block_on_gloo(vllm_ranks):
    """One request of a 1000-token vocab: 1000 B per exchange on gloo, under the
    measured 64 KiB (commfold.cost, DSPARK_PICK): vLLM's block, its gather included."""
    case = dict(vocab=1000, dtype="bfloat16", seed=9, ties=False, reqs=1, positions=3)
    _check(vllm_ranks.run(_blocks, False, [case], True), local=False)
