"""Sampled steps with top-k / top-p on Model Runner V2 (commfold.shard.bounds
through commfold.vllm.sample.sampled_pick) against V2's own ``GPUModelRunner.sample``: its
real Sampler, vLLM's top-k / top-p Triton kernel and V2's Gumbel kernel in Triton's
interpreter, on 2 gloo ranks (4 with -m slow). The same step both ways must give the
same tokens bit for bit; a step is drawn from the shards (one more small all-gather:
the cut's bounds; one more where a row's draw hangs on the cut's edge: those rows made
whole for vLLM's kernel) or given back with the reason in the step log - the
candidates not reaching the mass p, more rows at the cut's edge than pay, a top_k too
large to pay - and then its tokens are V2's own."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.sampled_checks import check
from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed(group="module")

V = 1500  # padded to 1536: rank 1 holds 732 real columns (candidates: 192 per rank)

CASES = [
    # peaked rows (hidden scaled): the cut lies among the gathered candidates
    dict(vocab=V, dtype="float32", seed=31, ties=False, rows=4, mode="sample", scale=4.0,
         params=dict(temperature=0.8, seed=7, top_k=5)),
    dict(vocab=V, dtype="bfloat16", seed=32, ties=False, rows=3, mode="sample", scale=5.0,
         edge=True, params=dict(temperature=1.0, seed=11, top_p=0.9)),
    dict(vocab=V, dtype="float32", seed=41, ties=False, rows=3, mode="sample", scale=6.0,
         params=dict(temperature=0.7, seed=12, top_p=0.5)),  # the top token holds p
    dict(vocab=V, dtype="float32", seed=33, ties=False, rows=2, mode="sample", scale=4.0,
         history=9, params=dict(temperature=0.7, seed=3, top_k=40, top_p=0.8, min_p=0.01,
                                repetition_penalty=1.2)),
    dict(vocab=V, dtype="float32", seed=34, ties=False, rows=4, mode="sample", scale=4.0,
         edge=True, row_params=[dict(temperature=0.9, seed=1, top_k=3),
                                dict(temperature=1.1, top_p=0.95),  # unseeded
                                dict(temperature=0.6, seed=2), dict(temperature=0.0)]),
    dict(vocab=V, dtype="float32", seed=35, ties=False, rows=2, mode="sample_logprobs",
         scale=4.0, params=dict(temperature=0.8, seed=5, top_k=10, logprobs=3)),
    # chat traffic: a JSON grammar's bitmask on the shards, then top-p / top-k
    dict(vocab=V, dtype="bfloat16", seed=42, ties=False, rows=3, mode="sample", scale=5.0,
         edge=True, grammar=dict(reqs=[0, 1], rows=["random", "few"], density=0.3),
         row_params=[dict(temperature=0.7, seed=4, top_p=0.95),
                     dict(temperature=0.9, seed=5, top_k=20, top_p=0.9),
                     dict(temperature=1.0, seed=6, top_k=2)]),
    # integer logits full of ties at the k-th value: drawn, or given back at the edge
    dict(vocab=V, dtype="float32", seed=36, ties=True, rows=3, mode="sample", edge=True,
         params=dict(temperature=1.0, seed=9, top_k=4)),
    # left to vLLM, with the reason
    dict(vocab=V, dtype="float32", seed=37, ties=False, rows=2, scale=0.3,  # flat rows
         mode="past the gathered candidates", params=dict(temperature=1.0, top_p=0.95)),
    dict(vocab=V, dtype="float32", seed=38, ties=False, rows=2, scale=4.0,
         mode="top_k=500 (local up to 191)", params=dict(temperature=1.0, top_k=500)),
    dict(vocab=V, dtype="float32", seed=39, ties=False, rows=2, scale=4.0,
         mode="processed logprobs after top-k", logprobs_mode="processed_logprobs",
         params=dict(temperature=1.0, top_k=8, logprobs=2)),
    # greedy requests: vLLM turns their top_k / top_p off (greedy, no cut)
    dict(vocab=V, dtype="float32", seed=40, ties=False, rows=2, scale=4.0,
         mode="greedy", params=dict(temperature=0.0, top_k=8, top_p=0.5)),
    # a draw at the edge of top_p 0.9 in 2 rows of 8 (bf16: up to a quarter): those rows
    # made whole, cut by vLLM's kernel, drawn over the whole row; the same with the
    # kernel run on no-op rows besides (as on CUDA, where the batch size picks its path)
    dict(vocab=V, dtype="bfloat16", seed=32, ties=False, rows=8, mode="sample", scale=5.0,
         made_whole=True, params=dict(temperature=1.0, seed=11, top_p=0.9)),
    dict(vocab=V, dtype="bfloat16", seed=32, ties=False, rows=8, mode="sample", scale=5.0,
         made_whole=True, padded=True, params=dict(temperature=1.0, seed=11, top_p=0.9)),
]


def test_top_k_top_p_steps_equal_v2s_sampler(vllm_v2_ranks):
    from harness.vllm_step_v2 import step_cases

    made = check(vllm_v2_ranks.run(step_cases, 2, CASES))
    assert any(made), made  # rows made whole, and steps without


ROW = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.5, 0.8, 1.0, 1.5]),
    "seed": st.one_of(st.none(), st.integers(-2**40, 2**40)),
    "top_k": st.sampled_from([0, 0, 1, 2, 7, 50, 150]),
    "top_p": st.sampled_from([1.0, 1.0, 0.3, 0.8, 0.95, 0.999]),
    "min_p": st.sampled_from([0.0, 0.0, 0.05]),
    "presence_penalty": st.sampled_from([0.0, 0.5]),
    "logprobs": st.sampled_from([None, None, 2]),
})


def _example(vocab, dtype, rows, ties, seed, scale, neg_inf):
    from harness.sampled_checks import mode_of

    mode = mode_of(rows)
    return dict(vocab=vocab, dtype=dtype, seed=seed, ties=ties, rows=len(rows),
                row_params=rows, mode=mode, edge=True, scale=scale, whole=None,
                any_reason=True, neg_inf_rows=(0,) if neg_inf else ())


EXAMPLE = dict(
    vocab=st.integers(1030, 1700), dtype=st.sampled_from(["float32", "bfloat16"]),
    rows=st.lists(ROW, min_size=1, max_size=4), ties=st.booleans(),
    seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 3.0, 6.0]),
    neg_inf=st.booleans())


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**EXAMPLE)
def test_top_k_top_p_examples(vllm_v2_ranks, **example):
    """top_k (1 to 150, ties at the k-th value with integer logits), top_p (0.3 to
    0.999), both, with min_p, penalties, logprobs, greedy rows, -inf rows, odd vocab
    sizes, both dtypes, seeds and none; drawn or given back, always V2's tokens."""
    from harness.vllm_step_v2 import step_cases

    check(vllm_v2_ranks.run(step_cases, 2, [_example(**example)]))


@pytest.mark.slow
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**EXAMPLE)
def test_top_k_top_p_sweep(vllm_v2_ranks4, **example):
    """The same on 4 ranks, more examples (opt-in: -m slow)."""
    from harness.vllm_step_v2 import step_cases

    check(vllm_v2_ranks4.run(step_cases, 4, [_example(**example)]))


CUT_CASE = dict(
    seed=st.integers(0, 2**16), vocab=st.integers(300, 2600),
    world=st.sampled_from([2, 4]), kind=st.sampled_from(["normal", "peaked", "ties"]),
    scale=st.sampled_from([0.3, 1.0, 3.0, 8.0]), bf16=st.booleans(),
    masked=st.sampled_from([0.0, 0.0, 0.5, 0.97]), max_k=st.sampled_from([1, 5, 60]))


def _within_bounds(ranks, case: dict) -> None:
    from harness.cut_cases import kept_and_bounds

    (res,) = ranks.run(kept_and_bounds, 2, [dict(case, rows=16)])[0]
    assert res["refused"] or res["reason"] is not None or res["broken"] == [], res
    assert not res["subset_differs"], res  # rows made whole: cut as in the whole batch


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**CUT_CASE)
def test_vllms_kernel_keeps_within_the_bounds(vllm_v2_ranks, **case):
    """The claim the draw rests on, row by row against vLLM's own kernel (Triton's
    interpreter): every token above `keep` kept, none below `drop`, every row with a
    token between marked in doubt; a third of the rows cut alone as in the whole set -
    over flat, peaked and tied rows, bf16-rounded values, rows mostly -inf, 2 and 4
    shards."""
    _within_bounds(vllm_v2_ranks, case)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**CUT_CASE)
def test_vllms_kernel_keeps_within_the_bounds_sweep(vllm_v2_ranks, **case):
    """The same over more rows (opt-in: -m slow)."""
    _within_bounds(vllm_v2_ranks, case)


def test_rows_made_whole_cost_at_most_half_of_vllms_gather(monkeypatch):
    """The limit: the rows' float32 columns at most half the bytes of vLLM's gather of
    the step's raw logits (a quarter of a bf16 step's rows, half a float32's); none
    without Triton (vLLM's sort-based cut may order ties by batch)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    from commfold.shard.edges import gathered_bytes
    from commfold.vllm.sample.shard_edge_rows import refusal

    monkeypatch.setattr(topk_topp_sampler, "HAS_TRITON", False)
    assert "sort-based" in refusal(1, 16, 2)
    monkeypatch.setattr(topk_topp_sampler, "HAS_TRITON", True)
    assert refusal(4, 16, 2) is None and "5 of 16 rows" in refusal(5, 16, 2)
    assert refusal(8, 16, 4) is None and refusal(9, 16, 4) is not None
    assert refusal(1, 3, 2) is not None and refusal(1, 3, 4) is None
    for d, rows, item in ((4, 16, 2), (8, 16, 4), (64, 256, 2)):
        assert 2 * gathered_bytes(d, 75968) <= rows * 75968 * item


def test_rows_made_whole_take_the_batchs_kernel_path(monkeypatch):
    """On CUDA-like platforms, where vLLM's kernel picks its path by batch size, a few
    rows of a batch over _SPLIT_MAX_BATCH run with no-op rows to over it; elsewhere,
    or where the batch is small too, as they are."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops import topk_topp_triton

    from commfold.vllm.sample.shard_edge_rows import kernel_rows

    split = topk_topp_triton._SPLIT_MAX_BATCH
    cpu = torch.device("cpu")
    assert kernel_rows(3, 256, cpu) == 3
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    assert kernel_rows(3, 256, cpu) == split + 1
    assert kernel_rows(3, split, cpu) == 3 and kernel_rows(split + 5, 256, cpu) == split + 5
