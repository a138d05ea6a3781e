"""commfold's probabilistic verification of spec-decode steps with sampled requests on
Model Runner V2 (commfold.vllm.spec_decode.shard_verify) against V2's own ``GPUModelRunner.sample``
and RejectionSampler - V2's Triton kernels in Triton's interpreter - on 2 gloo ranks:
the same step both ways must give the same sampled tokens (accepted drafts, the
resampled token at the first rejection, the bonus token) and counts bit for bit, with
one-hot drafts and with the drafter's cached logits, shard ends on and off V2's
8192-column blocks; the collectives counted (no vocab-wide gather); what stays V2's
keeps its path with the reason in the step log."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed(group="module")

ALIGNED = 32768  # shards of 16384 columns at TP=2: two whole 8192-column blocks each
ODD = 20011  # padded to 20032, shards of 10016: block 1 straddles the ranks


def _logprobs(case) -> bool:
    """Whether a request of the case asks for logprobs."""
    return any(p.get("logprobs") is not None for p in case["row_params"])


def _check(results):
    """Each result against V2's; returns how many rows each made whole."""
    from harness.sampled_checks import without_whole
    from harness.vllm_step_v2 import logprobs_agree, score_ulps, steps_as_v2s

    counts = []
    for r, case, where in steps_as_v2s(results):
        r = without_whole(r)  # the rows made whole: their gather checked
        counts.append(r["whole_rows"])
        if case.get("made_whole") is not None:
            assert bool(r["whole_rows"]) == case["made_whole"], (where, r["notes"])
        # the target as V2 processed and cut it, bit for bit, where both processed
        assert r["same_cut"] in (True, None), where
        if case["mode"] == "cut" and len(r["notes"]) == 1:
            assert r["same_cut"], where
        assert logprobs_agree(r), (where, r["logprobs"], r["vllm_logprobs"], r["ranks"])
        if r["logprobs"] is not None:
            assert r["score_diff"] <= score_ulps(case), (where, r["score_diff"])
        # scoring: local_topk_scores' two small exchanges
        scoring = 2 * _logprobs(case)
        if case["mode"] == "verify":  # all greedy: strict verification
            assert r["notes"] == ["verify"] and r["ours_gathers"] == 0, where
            assert r["calls"] == 1 + scoring, (where, r["calls"])
        elif case["mode"] == "verify_sampled":
            assert r["notes"] == ["verify_sampled"], where
            assert r["ours_gathers"] == 0, where
            aligned = case["vocab"] % (2 * 8192) == 0
            min_p = _min_p(case)
            # per-block stats, the resampled pair; the split blocks' parts where
            # a block runs past a shard; the row maxima for min_p
            assert r["calls"] == 2 + (not aligned) + min_p + scoring, (where, r["calls"])
            if not scoring:
                assert r["bytes"] == _bytes(case), (where, r["bytes"])
        elif case["mode"] == "cut":  # local (rows made whole), or given back
            assert r["notes"][0] == "verify_sampled", where
            assert len(r["notes"]) == 1 or r["notes"][1].startswith("vLLM (top-"), where
            assert r["ours_gathers"] == (len(r["notes"]) - 1), where
            if len(r["notes"]) == 1 and not scoring:  # the bounds' exchange besides
                assert r["bytes"] == _bytes(case, r["whole_rows"]) + _cut_bytes(case), \
                    (where, r["bytes"])
        else:
            assert r["notes"][-1].startswith("vLLM ("), where
            assert case["mode"] in r["notes"][-1], (where, r["notes"])
    return counts


def _processes(case) -> bool:
    """Whether V2 processes the step's logits: a request with penalties, bias, allowed
    ids, min_tokens or bad words, or a sampled one with a temperature other than 1 or
    min_p (V2 keeps neither for a greedy request)."""
    other = ("frequency_penalty", "presence_penalty", "logit_bias", "allowed_token_ids",
             "min_tokens", "_bad_words_token_ids")

    def row(p):
        t = p.get("temperature", 1.0)
        return any(p.get(k) for k in other) or p.get("repetition_penalty", 1.0) != 1.0 \
            or (t != 0.0 and (t != 1.0 or bool(p.get("min_p"))))
    return any(row(p) for p in case["row_params"])


def _min_p(case) -> bool:
    """Whether V2 runs its min_p kernel on the step: it processes the logits and a
    sampled request has min_p (V2 keeps no min_p for a greedy request)."""
    return _processes(case) and any(p.get("min_p") and p.get("temperature", 1.0) != 0.0
                                    for p in case["row_params"])


def _bytes(case, whole_rows: int = 0) -> int:
    """What commfold.shard.layout.exchanged_bytes says a rank sends for the case's step
    (whole_rows: rows made whole for vLLM's top-k / top-p kernel)."""
    from commfold.shard.layout import exchanged_bytes

    shard = -(-case["vocab"] // 64) * 64 // 2  # vLLM pads the vocab to 64
    rows = sum(case["drafts"]) + len(case["drafts"])
    item = 4 if case["dtype"] == "float32" else 2
    return exchanged_bytes(rows, len(case["drafts"]), shard, case["vocab"], 2, item,
                           case.get("draft_logits") is not None, _min_p(case),
                           _processes(case), whole_rows)


def _cut_bytes(case) -> int:
    """What commfold.shard.bounds.exchanged_bytes says a rank sends for the bounds of the
    case's top-k / top-p (each request's top_k / top_p on each of its rows)."""
    import torch

    from commfold.shard.bounds import exchanged_bytes

    v = case["vocab"]
    shard = -(-v // 64) * 64 // 2
    each = [(p.get("top_k") or v, p.get("top_p", 1.0))
            for p, n in zip(case["row_params"], case["drafts"]) for _ in range(n + 1)]
    if all(k == v and p == 1.0 for k, p in each):  # no cut: no bounds exchanged
        return 0
    return exchanged_bytes(len(each), torch.tensor([k for k, _ in each]),
                           torch.tensor([p for _, p in each]), v, shard)


def _bad_words(case: dict, reqs: int) -> list[list[int]]:
    """Bad words for a case with a history (harness.vllm_step_v2's, drawn alike): each
    request's last output token followed by a token on either shard (V2 masks that
    token where the request's output, drafts included, ends with the prefix), a word
    that matches nothing, single tokens."""
    from harness.vllm_step_v2 import _histories

    v = case["vocab"]
    lasts = [ids[-1] for _, ids in _histories(case, reqs)]
    return [[t, 100 + i] for i, t in enumerate(lasts)] + \
        [[t, v - 100 + i] for i, t in enumerate(lasts)] + [[v - 1, v - 2, 5], [33], [v - 300]]


T = dict(temperature=0.8, seed=7)
FIXED = [150, 15000, 9000, 19990]
CASES = [
    # one-hot drafts, aligned blocks, mostly accepted / mostly rejected / mixed
    dict(vocab=ALIGNED, dtype="float32", seed=1, ties=False, drafts=[3, 2],
         row_params=[T, dict(temperature=1.0, seed=3)], draft_kind="top",
         mode="verify_sampled"),
    dict(vocab=ALIGNED, dtype="bfloat16", seed=2, ties=False, drafts=[3, 3, 1],
         row_params=[T, dict(temperature=0.0), dict(temperature=1.5)],
         draft_kind="mixed", mode="verify_sampled"),
    # the drafter's cached logits (draft probabilities), shards off the blocks
    dict(vocab=ODD, dtype="float32", seed=3, ties=False, drafts=[2, 3],
         row_params=[T, dict(temperature=0.6, seed=11)], draft_logits=0.5,
         draft_kind="top", mode="verify_sampled"),
    dict(vocab=ODD, dtype="bfloat16", seed=4, ties=True, drafts=[3, 1, 2],
         row_params=[dict(temperature=1.0, seed=5), dict(temperature=0.0),
                     dict(temperature=0.9)], draft_logits=2.0, draft_kind="mixed",
         mode="verify_sampled"),
    dict(vocab=ALIGNED, dtype="float32", seed=5, ties=False, drafts=[2, 2],
         row_params=[T, T], draft_logits=0.1, draft_kind="random", mode="verify_sampled"),
    # drafts the drafter's own distribution rates unlikely: rejected, resampled from
    # the residual max(p - q, 0)
    dict(vocab=ODD, dtype="float32", seed=11, ties=False, drafts=[3, 2, 2],
         row_params=[T, dict(temperature=2.0, seed=4), dict(temperature=0.5)],
         draft_logits=4.0, draft_kind="random", mode="verify_sampled"),
    dict(vocab=ALIGNED, dtype="bfloat16", seed=12, ties=True, drafts=[2, 3],
         row_params=[dict(temperature=1.0, seed=8), dict(temperature=1.3, seed=9)],
         draft_logits=3.0, draft_kind="mixed", mode="verify_sampled"),
    # the vocab's edges, -inf rows, a request whose drafts are placeholders
    dict(vocab=ODD, dtype="float32", seed=6, ties=False, drafts=[2, 2],
         row_params=[T, dict(temperature=1.2, seed=2)], draft_kind="edge",
         neg_inf_rows=(1,), mode="verify_sampled"),
    # a resampled row of -inf logits only: V2 draws token 0 (its first block's first)
    dict(vocab=ODD, dtype="float32", seed=13, ties=False, drafts=[1, 2],
         row_params=[T, T], draft_kind="random", neg_inf_rows=(0,), mode="verify_sampled"),
    # the same with min_p and the drafter's logits: from vLLM 0.34 V2's resample kernel
    # skips the blocks whose target logits are all -inf (a request may mask logits)
    dict(vocab=ODD, dtype="float32", seed=16, ties=False, drafts=[1, 2],
         row_params=[dict(temperature=0.7, seed=3, min_p=0.2), T], draft_kind="random",
         neg_inf_rows=(0,), draft_logits=1.0, mode="verify_sampled"),
    dict(vocab=ODD, dtype="float32", seed=7, ties=False, drafts=[2, 2],
         row_params=[T, T], draft_kind="top", placeholder=1, draft_logits=0.3,
         mode="verify_sampled"),
    # NaN: gathered, V2's own; what stays V2's
    dict(vocab=ALIGNED, dtype="float32", seed=8, ties=False, drafts=[2, 1],
         row_params=[T, T], nan_column=20000, mode="NaN"),
    # min_p: V2's kernel on the shard with the row maximum over the ranks
    dict(vocab=ODD, dtype="float32", seed=9, ties=False, drafts=[2, 3],
         row_params=[dict(temperature=0.8, min_p=0.1), dict(temperature=1.0, seed=2)],
         draft_logits=1.0, draft_kind="mixed", mode="verify_sampled"),
    dict(vocab=ALIGNED, dtype="bfloat16", seed=14, ties=False, drafts=[3],
         row_params=[dict(temperature=0.5, seed=6, min_p=0.3)], draft_kind="random",
         mode="verify_sampled"),
    # penalties from the output so far and the step's drafts (V2 passes its draft
    # tokens), on a drafter's logits and one-hot
    dict(vocab=ODD, dtype="float32", seed=15, ties=False, drafts=[2, 3], history=8,
         row_params=[dict(temperature=0.8, seed=1, repetition_penalty=1.6,
                          frequency_penalty=0.4, presence_penalty=0.3),
                     dict(temperature=1.0, seed=2, presence_penalty=-2.0)],
         draft_logits=0.5, draft_kind="top", mode="verify_sampled"),
    # one token drafted again and again, biased to be accepted (p ~ 0.9) until the
    # penalty for the drafts before it (V2 counts them) makes it unlikely (~ 0.02);
    # the tokens on either shard
    dict(vocab=ODD, dtype="float32", seed=19, ties=False, drafts=[3, 3, 3, 3],
         row_params=[dict(temperature=1.0, seed=s, repetition_penalty=2.0,
                          logit_bias={t: 12.0}) for s, t in enumerate(FIXED)],
         draft_kind="fixed", fixed=FIXED, mode="verify_sampled"),
    dict(vocab=ALIGNED, dtype="bfloat16", seed=16, ties=True, drafts=[3, 1], history=12,
         row_params=[dict(temperature=0.0, repetition_penalty=3.0),
                     dict(temperature=0.7, seed=4, frequency_penalty=1.5, min_p=0.05)],
         draft_kind="mixed", mode="verify_sampled"),
    # logit bias on both shards, allowed ids across them (drafts outside rejected),
    # min_tokens' stop ids masked
    dict(vocab=ODD, dtype="bfloat16", seed=17, ties=False, drafts=[3, 2, 2],
         row_params=[dict(temperature=0.8, seed=1, logit_bias={3: 2.0, 19000: 5.5}),
                     dict(temperature=0.9, seed=2,
                          allowed_token_ids=[5, 17, 300, 10015, 10016, 20010]),
                     dict(temperature=1.0, seed=3, min_tokens=5,
                          stop_token_ids=list(range(0, ODD, 181)))],
         draft_logits=1.0, draft_kind="mixed", mode="verify_sampled"),
]
# a thinking budget: V2 forces the end marker once a request's reasoning (its drafts
# counted) reaches the budget - the marker's next token where the row's text already
# ends with its first - and nothing after a natural end; markers on both shards
CASES += [dict(vocab=ODD, dtype="float32", seed=24, ties=False, drafts=[2, 2, 2, 3],
               history=8, reasoning=dict(start=[12001], natural_end=[12002], end=[17, 19990]),
               tails=[[12001, 5], [12001, 5, 6, 17], [12001, 12002], [12001]],
               row_params=[dict(temperature=0.8, seed=s, thinking_token_budget=b)
                           for s, b in enumerate((3, 1, 1, 2))],
               draft_kind="fixed", fixed=[17, 19990, 17, 17], mode="verify_sampled")]
# top-k / top-p: V2 cuts the target logits before verifying; taken where the bounds
# of the kernel's cut leave no token in doubt, the rows where they do made whole and
# cut by vLLM's kernel (up to half the bytes of vLLM's gather), else given back
CUT = dict(vocab=ODD, dtype="float32", ties=False, draft_kind="mixed", mode="cut")
CASES += [dict(CUT, seed=30, drafts=[2, 2], row_params=[
              dict(temperature=0.8, seed=1, top_k=1), dict(temperature=0.7, seed=2, top_k=2)]),
          dict(CUT, seed=31, drafts=[3, 1], draft_logits=0.5, row_params=[
              dict(temperature=1.0, seed=3, top_k=20), dict(temperature=0.9, seed=4)]),
          dict(CUT, seed=32, drafts=[2, 2], dtype="bfloat16", row_params=[
              dict(temperature=0.8, seed=5, top_p=0.9), dict(temperature=1.0, seed=6,
                                                             top_p=0.5, top_k=10)]),
          dict(CUT, seed=33, drafts=[2], row_params=[
              dict(temperature=0.6, seed=7, top_p=0.05, min_p=0.1)]),
          # one token holding the mass p in every row: the cut is certain (top-p)
          dict(CUT, seed=34, drafts=[2, 3], draft_kind="fixed", fixed=[12345, 77],
               row_params=[dict(temperature=1.0, seed=8, top_p=0.5, logit_bias={12345: 15.0}),
                           dict(temperature=0.5, seed=9, top_p=0.9,
                                logit_bias={77: 12.0})])]
PLAIN = [dict(temperature=0.9, seed=20), dict(temperature=0.7, seed=21),
         dict(temperature=1.2, seed=22)]
CASES += [
    # top_p 0.9 on one request of four (bf16: its 4 rows of 16, a quarter, made whole)
    dict(CUT, seed=40, dtype="bfloat16", scale=4.0, drafts=[3, 3, 3, 3], made_whole=True,
         row_params=[dict(temperature=0.8, seed=1, top_p=0.9), *PLAIN]),
    # top_p 0.95 and top-k + top-p, the drafter's logits: 8 rows of 16 (float32: half)
    dict(CUT, seed=41, scale=4.0, drafts=[3, 3, 3, 3], draft_kind="top", draft_logits=0.5,
         made_whole=True, row_params=[dict(temperature=0.7, seed=1, top_p=0.95),
                                      dict(temperature=1.0, seed=2, top_k=30, top_p=0.9),
                                      *PLAIN[:2]]),
    # integer logits: ties at the k-th value
    dict(CUT, seed=42, ties=True, drafts=[3, 3, 3, 3], made_whole=True,
         row_params=[dict(temperature=1.0, seed=1, top_k=4), *PLAIN]),
    # top_p on two requests of four, bf16: 8 rows of 16 in doubt, more than pays
    dict(CUT, seed=40, dtype="bfloat16", scale=4.0, drafts=[3, 3, 3, 3], made_whole=False,
         row_params=[dict(temperature=0.8, seed=1, top_p=0.9),
                     dict(temperature=1.0, seed=2, top_p=0.95), *PLAIN[1:]])]
# bad words (matched through the output so far; their masked tokens biased far above
# the rest, so a word left unmasked is accepted or resampled)
BAD = dict(vocab=ODD, dtype="float32", seed=18, ties=False, drafts=[2, 2], history=6,
           draft_kind="random", mode="verify_sampled")
CASES += [dict(BAD, row_params=[
    dict(temperature=0.8, seed=3 + i, _bad_words_token_ids=_bad_words(BAD, 2),
         logit_bias={100: 60.0, 101: 60.0, ODD - 100: 55.0, ODD - 99: 55.0})
    for i in range(2)])]
# logprobs of each verified row's token (V2 scores the accepted drafts, the
# resampled or bonus token, and 0 past them), top ones beside; raw and processed
CASES += [
    dict(vocab=ODD, dtype="float32", seed=10, ties=False, drafts=[2, 3],
         row_params=[dict(temperature=0.8, seed=1, logprobs=2),
                     dict(temperature=1.0, seed=2, logprobs=0)],
         draft_logits=0.5, draft_kind="mixed", mode="verify_sampled"),
    dict(vocab=ALIGNED, dtype="bfloat16", seed=20, ties=True, drafts=[3, 1],
         row_params=[dict(temperature=0.7, seed=3, logprobs=3, presence_penalty=0.5),
                     dict(temperature=0.0, logprobs=1)], history=5,
         draft_kind="top", logprobs_mode="processed_logprobs", mode="verify_sampled"),
    dict(vocab=ODD, dtype="float32", seed=21, ties=False, drafts=[2, 2], history=3,
         row_params=[dict(temperature=0.9, seed=4, frequency_penalty=0.5, logprobs=4),
                     dict(temperature=1.2, seed=5, logprobs=1)],
         draft_kind="random", logprobs_mode="processed_logits", mode="verify_sampled"),
    dict(vocab=ODD, dtype="bfloat16", seed=22, ties=True, drafts=[3, 2],
         row_params=[dict(temperature=0.0, logprobs=2), dict(temperature=0.0)],
         draft_kind="mixed", logprobs_mode="raw_logits", mode="verify"),
    dict(vocab=ODD, dtype="float32", seed=23, ties=False, drafts=[2],
         row_params=[dict(temperature=0.8, logprobs=1, logprob_token_ids=[3, 900])],
         mode="logprob_token_ids"),
]


def test_sampled_verification_equals_v2s(vllm_v2_ranks):
    from harness.vllm_verify_v2 import verify_cases

    results = vllm_v2_ranks.run(verify_cases, 2, CASES)
    made = _check(results)
    assert any(made), made  # rows made whole for vLLM's top-k / top-p kernel
    # the cases reach both outcomes: some drafts accepted, some rejected
    accepted = [a for res in results for r in res for a in r["accepted"]]
    assert 0 in accepted and any(a >= 2 for a in accepted), accepted
    # top-k / top-p steps taken on the shards, and given back
    cuts = [len(r["notes"]) for res in results for r in res if r["case"]["mode"] == "cut"]
    assert 1 in cuts and 2 in cuts, cuts
    # a draft rejected against the drafter's logits (the residual resampled)
    assert any(a < n for res in results for r in res if r["case"].get("draft_logits")
               for a, n in zip(r["accepted"], r["case"]["drafts"])), accepted


ROW = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7]),
    "seed": st.one_of(st.none(), st.integers(-2**40, 2**40)),
    "min_p": st.sampled_from([0.0, 0.0, 0.05, 0.3]),
    "presence_penalty": st.sampled_from([0.0, 0.0, 0.7]),
    "logprobs": st.sampled_from([None, None, 0, 3]),
})


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vocab=st.integers(8200, 24600), dtype=st.sampled_from(["float32", "bfloat16"]),
       rows=st.lists(ROW, min_size=1, max_size=3), ties=st.booleans(),
       seed=st.integers(0, 2**16), steps=st.lists(st.integers(1, 3), min_size=3, max_size=3),
       noise=st.sampled_from([None, 0.2, 3.0]),
       kind=st.sampled_from(["top", "random", "mixed", "edge"]))
def test_sampled_verification_examples(vllm_v2_ranks, vocab, dtype, rows, ties, seed, steps,
                                       noise, kind):
    """Odd vocab sizes (block boundaries anywhere in the shards), temperatures, seeds
    (and none: V2's numpy draw), greedy rows mixed in, one-hot and cached drafts,
    presence penalties (with the drafts counted), logprobs."""
    from harness.vllm_verify_v2 import verify_cases

    # V2 processes a greedy request's logits for its penalty: drawn, not argmax
    sampled = any(r["temperature"] != 0.0 or r["presence_penalty"] for r in rows)
    case = dict(vocab=vocab, dtype=dtype, seed=seed, ties=ties, drafts=steps[:len(rows)],
                row_params=rows, draft_logits=noise, draft_kind=kind, history=4,
                mode="verify_sampled" if sampled else "verify")
    _check(vllm_v2_ranks.run(verify_cases, 2, [case]))


CUT_ROW = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.5, 0.8, 1.0, 1.3]),
    "seed": st.one_of(st.none(), st.integers(-2**40, 2**40)),
    "top_k": st.sampled_from([0, 0, 1, 4, 30]),
    "top_p": st.sampled_from([1.0, 0.5, 0.9, 0.95]),
})


@pytest.mark.slow  # the fixed cases above cover the rows made whole; ~1 min more
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vocab=st.integers(8200, 24600), dtype=st.sampled_from(["float32", "bfloat16"]),
       cut=CUT_ROW, ties=st.booleans(), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1.0, 4.0]), noise=st.sampled_from([None, 0.5]))
def test_top_k_top_p_verification_examples(vllm_v2_ranks, vocab, dtype, cut, ties, seed,
                                           scale, noise):
    """One request of four with top-k / top-p (of 16 rows): taken - its rows in doubt
    made whole for vLLM's kernel, or none in doubt - or given back with the reason;
    V2's tokens either way."""
    from harness.vllm_verify_v2 import verify_cases

    case = dict(vocab=vocab, dtype=dtype, seed=seed, ties=ties, drafts=[3, 3, 3, 3],
                row_params=[cut, *PLAIN], draft_logits=noise, draft_kind="mixed",
                scale=scale, mode="cut")
    _check(vllm_v2_ranks.run(verify_cases, 2, [case]))


def test_decision_names_the_mode():
    from commfold.vllm.target.decision import V2Step, decide_v2

    step = V2Step(temperatures=(0.8, 0.0), top_k_or_p=False, needs_processing=True,
                  logprobs=False, processing=("temperature",))
    assert decide_v2(step, spec=True, structured=False, verify="standard")[0] == \
        "verify_sampled"
    assert decide_v2(V2Step(**{**step.__dict__, "processing": ("temperature", "min_p")}),
                     spec=True, structured=False, verify="standard")[0] == "verify_sampled"
    for changed in (dict(processing=("temperature", "bad_words", "thinking_budget")),
                    dict(processing=("penalties", "logit_bias", "min_p"))):
        assert decide_v2(V2Step(**{**step.__dict__, **changed}), spec=True,
                         structured=False, verify="standard")[0] == "verify_sampled"
    for changed, why in ((dict(processing=("temperature", "thinking_budget", "custom")),
                          "custom"),
                         (dict(logprobs=True, logprob_token_ids=True), "logprob_token_ids"),
                         (dict(logprobs=True, num_logprobs=21), "logprobs=21"),
                         (dict(processing=("penalties", "custom")), "custom")):
        mode, reason = decide_v2(V2Step(**{**step.__dict__, **changed}), spec=True,
                                 structured=False, verify="standard")
        assert mode is None and why in reason, reason
    # top-k / top-p: V2's verification cuts with its kernel, never a fused sampler
    cut = V2Step(**{**step.__dict__, "top_k_or_p": True, "fused_sampler": True,
                    "processing": ("temperature", "top_k", "top_p")})
    assert decide_v2(cut, spec=True, structured=False, verify="standard")[0] == \
        "verify_sampled"
    assert decide_v2(cut, spec=False, structured=False)[0] is None  # the draw's: vLLM's
    for changed in (dict(split_top_p=True),
                    dict(logprobs=True, num_logprobs=2, logprobs_mode="processed_logprobs")):
        mode, reason = decide_v2(V2Step(**{**cut.__dict__, **changed}), spec=True,
                                 structured=False, verify="standard")
        assert mode is None and "top-" in reason, reason
    assert decide_v2(step, spec=True, structured=False, verify="block")[0] is None
    assert decide_v2(step, spec=False, structured=False)[0] == "sample"


@pytest.mark.parametrize("stride,last,eff,width,size", [
    (20032, False, 20011, 8192, 8193),  # V2's vocab_size odd: ours too, past our block
    (20032, True, 20011, 11819, 11819),  # our last block ends the vocab: eff's residue
    (32768, False, 32768, 16384, 16384), (151936, False, 151936, 81920, 81920)])
def test_the_stats_launch_is_specialized_as_v2s(stride, last, eff, width, size):
    """V2's stats kernel on our blocks gets V2's row stride and a vocab_size dividing
    by 16 exactly when V2's does (Triton compiles per divisibility)."""
    import torch

    from commfold.vllm.spec_decode.shard_verify import like_v2

    whole = torch.arange(2 * width, dtype=torch.float32).view(2, width)
    buf, got = like_v2(whole, stride, last, eff)
    assert buf.stride(0) == stride and got == size and (got % 16 == 0) == (eff % 16 == 0)
    assert torch.equal(buf[:, :width], whole)


def test_the_verification_is_pinned_to_this_vllms_kernels():
    """Every V2 function verify() launches or repeats hashes to the source of the
    claimed release this vLLM is read as (the hook row covers every claimed release;
    pins decide), and the kernels are launched with that release's argument lists."""
    from commfold.vllm.compat import hook_points, hooks, releases
    from commfold.vllm.spec_decode import shard_verify, verify_kernels

    assert hook_points.missing(shard_verify.POINTS) == []
    assert shard_verify.refusal(SimpleNamespace(watermark_key=None)) is None
    (row,) = [h for h in hooks.HOOKS if h.name == shard_verify.HOOK]
    assert row.points == shard_verify.POINTS and row.until is None and not row.wraps
    assert set(verify_kernels.POINTS) <= set(shard_verify.POINTS)
    here = releases.here()
    assert here.release is not None and verify_kernels.form() == here.release.numbers
    # a pinned kernel's source of another claimed release is not this one's: refused
    where, pinned = verify_kernels.POINTS[0]
    others = {h for r, h in pinned.hashes if r != here.release.version}
    mine = {h for r, h in pinned.hashes if r == here.release.version}
    for digest in others - mine:
        assert not pinned.holds_for(digest, here.release.version), where


def test_each_kernel_gets_exactly_its_parameters(vllm_v2_ranks):
    """Every kernel verify_kernels launches gets each of the installed kernel's
    parameters by name and nothing else (Triton's interpreter drops a name the kernel
    lacks, a GPU launch refuses it)."""
    from harness.vllm_verify_v2 import launch_arguments

    for kernel, (passed, params) in vllm_v2_ranks.run(launch_arguments, 2)[0].items():
        assert passed == params, kernel


METHODS = {
    "fly": dict(rejection_sample_method="fly", fly_window_size=2,
                fly_entropy_threshold=0.3, fly_entropy_top_k=3),
    "block": dict(rejection_sample_method="block"),
    "synthetic": dict(rejection_sample_method="synthetic",
                      synthetic_acceptance_rates=[0.5, 0.3]),
    "adaptive": dict(enable_adaptive_verification=True),
}


def test_other_verification_methods_keep_the_step_vllms(vllm_v2_ranks):
    """V2's RejectionSampler built for FLy's window (from 0.33), block verification,
    synthetic rates or adaptive verification: the step stays V2's, the method named,
    from the config (decide_step) and, where the sampler records it, from what it was
    built for (refusal)."""
    from harness.vllm_verify_v2 import method_refusals

    got = vllm_v2_ranks.run(method_refusals, 2, METHODS)[0]
    assert got["block"] and got["synthetic"] and got["adaptive"], got
    for method, result in got.items():
        if result is None:
            continue
        built, refused, (mode, why) = result
        assert mode is None and method in why, (method, why)
        if built == method:  # the release knows the method
            assert refused is not None and method in refused, (method, refused)
        else:  # 0.32 has no FLy: its sampler verifies "standard"; the config refuses
            assert method == "fly" and built is None and refused is None, result


def test_a_batch_sharded_draft_cache_keeps_the_step_vllms():
    """0.34's DraftLogitsCache sharded over the ranks (a row mapping: each rank holds
    its own requests' draft logits) is given back; a replicated one, or a tensor, is
    verified, its values read."""
    import torch

    from commfold.vllm.spec_decode import shard_verify, verify_kernels

    values = torch.zeros(2, 1, 4)
    sharded = SimpleNamespace(values=values, row_mapping=torch.zeros(2, dtype=torch.int32))
    assert "batch-sharded" in shard_verify.draft_refusal(sharded)
    for replicated in (SimpleNamespace(values=values, row_mapping=None), values, None):
        assert shard_verify.draft_refusal(replicated) is None
        assert verify_kernels.values(replicated) is (None if replicated is None else values)


def test_a_moved_kernel_or_watermarks_keep_the_step_vllms(monkeypatch, caplog):
    """A release whose kernel no pin matches refuses the mode (one warning, the reason
    per step, from decide_step as the hooks call it); so does a watermarked
    RejectionSampler."""
    import logging

    from commfold.vllm.spec_decode import shard_verify
    from commfold.vllm.target import v2_pick
    from commfold.vllm.compat.hook_points import Pinned

    class RejectionSampler:  # what decide_step reads of V2's
        watermark_key = None
        use_block_verification = False

    monkeypatch.setattr(v2_pick, "step_of", lambda *a, **k: None)
    monkeypatch.setattr(v2_pick, "decide_v2",
                        lambda *a, **k: ("verify_sampled", "sampled: temperature"))
    batch = SimpleNamespace(num_reqs=2, num_draft_tokens=4)
    spec = SimpleNamespace(rejection_sample_method="standard",
                           enable_adaptive_verification=False)
    rejection = RejectionSampler()

    def decide():
        return v2_pick.decide_step(object(), rejection, spec, batch, False, 4096)

    assert decide() == ("verify_sampled", "sampled: temperature")
    where, _ = shard_verify.POINTS[3]
    moved = ((where, Pinned((("9.9.9", "0" * 16),))),)
    monkeypatch.setattr(shard_verify, "POINTS", shard_verify.POINTS[:3] + moved
                        + shard_verify.POINTS[4:])
    shard_verify.moved.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, "commfold"):
            first, again = decide(), decide()
        assert first == again and first[0] is None and where in first[1], first
        lines = [r.getMessage() for r in caplog.records if shard_verify.HOOK in r.getMessage()]
        assert len(lines) == 1, lines
    finally:
        shard_verify.moved.cache_clear()
    monkeypatch.setattr(shard_verify, "POINTS", shard_verify.POINTS[:3] +
                        shard_verify.POINTS[4:])
    rejection.watermark_key = 5
    assert decide() == (None, "watermarked verification")
