"""commfold's pick of sampled steps on Model Runner V2 (commfold.vllm.sample.sampled_pick)
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

from harness.sampled_checks import check as _check
from harness.sampled_checks import mode_of as _mode
from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed(group="module")

V = 1500  # padded to 1536: at TP=2 rank 1 holds 732 real columns + 36 padding
V4 = 1050  # padded to 1088: at TP=4 shards of 272 columns (starts inside a 32-token word)


def _bad_words(seed: int, reqs: int) -> list[list[int]]:
    """Bad words for a case with history=6 (harness.vllm_step_v2's histories, drawn
    alike): each request's last output token followed by a token on either shard
    (V2 masks those where that request's output matches), a word that does not match,
    single tokens."""
    from harness.vllm_step_v2 import _histories

    lasts = [ids[-1] for _, ids in _histories(dict(history=6, seed=seed, vocab=V), reqs)]
    return [[t, 100 + i] for i, t in enumerate(lasts)] + \
        [[t, 1200 + i] for i, t in enumerate(lasts)] + [[1499, 1498, 5], [33], [1300]]


def _history_ids(seed: int, reqs: int, n: int, prompt: bool = False) -> list[list[int]]:
    """Per request: its output tokens of history=n (and its prompt's), and 4 others."""
    from harness.vllm_step_v2 import _histories

    hist = _histories(dict(history=n, seed=seed, vocab=V), reqs)
    return [sorted(set(ids if prompt else ids[-n:]) | {3, 700, 1100, 1490})
            for _, ids in hist]


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
    # penalties: each request allowed only its prompt / output tokens and a few others,
    # so the penalties decide the draw (on either shard)
    dict(vocab=V, dtype="bfloat16", seed=5, ties=True, rows=2, mode="sample", history=12,
         row_params=[dict(temperature=0.0, repetition_penalty=2.0,
                          frequency_penalty=0.3, presence_penalty=0.2, allowed_token_ids=a)
                     for a in _history_ids(5, 2, 12, prompt=True)]),  # greedy
    dict(vocab=V, dtype="float32", seed=6, ties=False, rows=2, mode="sample", history=20,
         row_params=[dict(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0,
                          allowed_token_ids=a) for a in _history_ids(6, 2, 20)]),  # greedy
    dict(vocab=V, dtype="float32", seed=24, ties=True, rows=2, mode="sample", history=9,
         params=dict(temperature=0.8, seed=1, repetition_penalty=1.3)),
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
    # logit bias on both shards, allowed ids on one (the other rank masks its whole
    # shard), min_tokens' stop ids (pos + 1 < min_len: masked)
    dict(vocab=V, dtype="bfloat16", seed=13, ties=True, rows=3, mode="sample",
         row_params=[dict(temperature=0.8, seed=1, logit_bias={3: 2.0, 1400: 5.5}),
                     dict(temperature=0.9, seed=2, allowed_token_ids=[5, 17, 300, 301]),
                     dict(temperature=1.0, seed=3, min_tokens=5, stop_token_ids=[
                         int(t) for t in range(0, 1500, 13)])]),
    dict(vocab=V, dtype="float32", seed=15, ties=False, rows=2, mode="sample_logprobs",
         row_params=[dict(temperature=0.0, allowed_token_ids=[900, 1499, 2], logprobs=2),
                     dict(temperature=0.5, logit_bias={800: -100.0, 801: 30.0},
                          min_p=0.1)], logprobs_mode="processed_logprobs",
         whole=None),  # rows of -inf but a few: local_logprobs may score them whole
    # bad words: one-token words, words whose prefix is the output so far (matched)
    # or not, their last tokens on either shard
    # (the masked tokens biased far above the rest: a word left unmasked is drawn)
    dict(vocab=V, dtype="float32", seed=14, ties=True, rows=2, mode="sample", history=6,
         params=dict(temperature=0.8, seed=3, _bad_words_token_ids=_bad_words(14, 2),
                     logit_bias={100: 60.0, 101: 60.0, 1200: 55.0, 1201: 55.0})),
    dict(vocab=V, dtype="bfloat16", seed=16, ties=False, rows=2, mode="sample", history=6,
         row_params=[dict(temperature=0.0, _bad_words_token_ids=_bad_words(16, 2),
                          logit_bias={100: 60.0, 1200: 55.0, 1300: 50.0}),
                     dict(temperature=1.0, seed=5)]),
    # a thinking budget: V2 forces the reasoning end marker (1e9) once a request's
    # reasoning since its start marker reaches the budget - the marker's next token
    # where the output already ends with its first -, nothing after a natural end or
    # under budget; the markers on both shards
    dict(vocab=V, dtype="float32", seed=25, ties=False, rows=4, mode="sample", history=8,
         reasoning=dict(start=[1201], natural_end=[1202], end=[17, 1497]),
         tails=[[1201, 5, 6, 7], [1201, 5, 17], [1201, 5, 1202], [1201, 5]],
         row_params=[dict(temperature=0.8, seed=s, thinking_token_budget=b)
                     for s, b in enumerate((2, 1, 1, 50))]),
    # left to vLLM, with the reason
    dict(vocab=V, dtype="float32", seed=17, ties=True, rows=2, mode="logprob_token_ids",
         params=dict(temperature=0.8, logprobs=1, logprob_token_ids=[3, 900])),
]


def test_sampled_steps_equal_v2s_sampler(vllm_v2_ranks):
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks.run(step_cases, 2, CASES))


CASES4 = [  # shards starting inside a 32-token word (the prompt bit mask re-packed)
    dict(vocab=V4, dtype="float32", seed=21, ties=True, rows=3, mode="sample",
         params=dict(temperature=0.8, seed=4, repetition_penalty=1.5,
                     presence_penalty=0.5, min_p=0.02), history=15),
    dict(vocab=V4, dtype="bfloat16", seed=22, ties=False, rows=2, mode="sample_logprobs",
         params=dict(temperature=0.6, seed=2, frequency_penalty=0.4, logprobs=2),
         history=30, logprobs_mode="processed_logprobs"),
    dict(vocab=V4, dtype="float32", seed=23, ties=False, rows=4, mode="sample",
         row_params=[dict(temperature=0.0), dict(temperature=1.0, seed=11),
                     dict(temperature=0.3, min_p=0.3), dict(temperature=2.0, seed=-5)],
         positions=[0, 9, 1000, 77]),
]


@pytest.mark.slow
def test_sampled_steps_on_4_ranks(vllm_v2_ranks4):
    """Opt-in (-m slow: a 4-rank pool of its own); the re-packing itself is checked
    without ranks below."""
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks4.run(step_cases, 4, CASES4))


ROW = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7]),
    "seed": st.one_of(st.none(), st.integers(-2**40, 2**40)),
    "min_p": st.sampled_from([0.0, 0.0, 0.05, 0.3]),
    "repetition_penalty": st.sampled_from([1.0, 1.0, 1.3, 0.8]),
    "frequency_penalty": st.sampled_from([0.0, 0.0, 0.5]),
    "presence_penalty": st.sampled_from([0.0, -0.4]),
    "logprobs": st.sampled_from([None, None, 0, 3]),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(0, 1029),
                                                       st.floats(-5, 5), max_size=4)),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 1029), min_size=1,
                                                       max_size=5)),
})


def _example(vocab, dtype, rows, ties, seed, history, positions, mode, neg_inf):
    return dict(vocab=vocab, dtype=dtype, seed=seed, ties=ties, rows=len(rows),
                row_params=rows, mode=_mode(rows), history=history, whole=None,
                positions=positions[:len(rows)], logprobs_mode=mode,
                neg_inf_rows=(0,) if neg_inf else ())


EXAMPLE = dict(
    vocab=st.integers(1030, 1700), dtype=st.sampled_from(["float32", "bfloat16"]),
    rows=st.lists(ROW, min_size=1, max_size=4), ties=st.booleans(),
    seed=st.integers(0, 2**16), history=st.sampled_from([None, 10, 39]),
    positions=st.lists(st.integers(0, 5000), min_size=4, max_size=4),
    mode=st.sampled_from(["raw_logprobs", "processed_logprobs", "raw_logits",
                          "processed_logits"]),
    neg_inf=st.booleans())


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**EXAMPLE)
def test_sampled_examples(vllm_v2_ranks, **example):
    """Temperatures, seeds (and none: V2's numpy draw), positions, min_p, penalties
    with output histories, logprobs in V2's four modes, -inf rows, odd vocab sizes
    (padding on the last shard), both dtypes, ties; greedy rows mixed in."""
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks.run(step_cases, 2, [_example(**example)]))


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**EXAMPLE)
def test_sampled_examples_sweep(vllm_v2_ranks4, **example):
    """The same on 4 ranks, more examples (opt-in: -m slow)."""
    from harness.vllm_step_v2 import step_cases

    _check(vllm_v2_ranks4.run(step_cases, 4, [_example(**example)]))


def test_the_draw_is_pinned_to_this_vllms_sampler_functions():
    """Every V2 function the draw repeats on a shard hashes to a source commfold read
    for this release (the release tier runs this on 0.34's classes)."""
    from commfold.vllm.compat import hook_points
    from commfold.vllm.sample import sampled_pick

    assert hook_points.missing(sampled_pick.POINTS) == []
    assert sampled_pick.refusal() is None


def test_a_changed_sampler_function_sends_sampled_steps_to_vllm(monkeypatch, caplog):
    """A release that changed one function the draw repeats (here: a pin that no source
    matches) turns sampled steps off with one warning and a reason per step; the hook's
    row says off and why."""
    import logging

    from commfold.vllm.sample import sampled_pick
    from commfold.vllm.compat.hook_points import Pinned
    from commfold.vllm.compat.runtime import Runner

    where, _ = sampled_pick.POINTS[2]
    moved = ((where, Pinned((("9.9.9", "0" * 16),))),)
    monkeypatch.setattr(sampled_pick, "POINTS", sampled_pick.POINTS[:2] + moved
                        + sampled_pick.POINTS[3:])
    sampled_pick.refusal.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, "commfold"):
            why, again = sampled_pick.refusal(), sampled_pick.refusal()
        assert why == again and where in why, why
        lines = [r.getMessage() for r in caplog.records if "sampled steps off" in r.getMessage()]
        assert len(lines) == 1 and where in lines[0], lines
        state = sampled_pick.state({}, Runner(2, "the test's choice"))
        assert not state.on and state.problem and where in state.reason, state
    finally:
        sampled_pick.refusal.cache_clear()
