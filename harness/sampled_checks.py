"""What every sampled-step result of harness.vllm_step_v2.step_cases must hold against
V2's own Sampler (tests of commfold.vllm.sample.sampled_pick): the same tokens, the decision
the case names, the collectives the pick needs and no vocab-wide gather on a step
taken; on a step left to vLLM, the reason in the step log and vLLM's gather."""
from __future__ import annotations


EDGE = "top-k / top-p: a token at the cut's edge"  # how the edge rows' refusals start
WHOLE = "rows made whole for vLLM's top-k / top-p kernel"  # shard_edge_rows.note's end


def made_whole(r) -> int:
    """How many rows a step's result made whole for vLLM's top-k / top-p kernel (its
    step-log note, commfold.vllm.sample.shard_edge_rows), the gather that did so checked:
    one of [rows, shard] float32 per rank, as many bytes as
    commfold.shard.edges.gathered_bytes says."""
    from commfold.shard.edges import gathered_bytes
    from commfold.vllm.sample.shard_edge_rows import note

    made = [n for n in r["notes"] if n.endswith(WHOLE)]
    if not made:
        return 0
    assert len(made) == 1, r["notes"]
    d = int(made[0].split()[0])
    assert made[0] == note(d) and d > 0, made
    shape = [[d, r["shard"]]]  # (rows scored whole for logprobs gather apart)
    assert (shape, gathered_bytes(d, r["shard"])) in [(s, b) for s, _, b in r["wide"]], \
        r["wide"]
    return d


def without_whole(r) -> dict:
    """r with the rows-made-whole note, gather and call taken out (checked first by
    made_whole); "whole_rows": how many rows."""
    d = made_whole(r)
    return dict(r, notes=[n for n in r["notes"] if not n.endswith(WHOLE)],
                ours_gathers=r["ours_gathers"] - bool(d), calls=r["calls"] - bool(d),
                whole_rows=d)


def check(results):
    """case["mode"]: the decision's mode, or a part of the reason vLLM keeps the step;
    case["edge"]: True where the step may also be given back at a top-k / top-p cut's
    edge (which of the two the draw shows; the tokens must be V2's either way);
    case["any_reason"]: ... or for any top-k / top-p reason (generated cases);
    case["made_whole"]: True where rows must be made whole (the step taken), False
    where none may be. Returns how many rows each result made whole."""
    from harness.vllm_step_v2 import score_ulps, steps_as_v2s

    from commfold.vllm.sample.shard_grammar import NOTE  # a grammar's bitmask, noted apart

    counts = []
    for r, case, where in steps_as_v2s(results):
        r = without_whole(dict(r, notes=[n for n in r["notes"] if n != NOTE]))
        counts.append(r["whole_rows"])
        if case.get("made_whole") is not None:
            assert bool(r["whole_rows"]) == case["made_whole"], (where, r["notes"])
        # rows made whole: cut as V2 cut them, bit for bit
        assert (r["same_cut"] is None) == (not r["whole_rows"]), where
        assert r["same_cut"] in (True, None), where
        mode = case["mode"]
        gathers, whole = r["ours_gathers"], case.get("whole", False)
        note = r["notes"][-1] if r["notes"] else ""
        if case.get("edge") and EDGE in note:
            mode = EDGE
        if case.get("any_reason") and note.startswith(("vLLM (top-", "vLLM (top_k=")):
            mode = note
        if mode in ("sample", "sample_logprobs", "greedy", "logprobs"):
            assert r["notes"] == [mode], where
            # rows scored whole (logprobs) are gathered; None: either
            assert gathers <= 1 if whole is None else gathers == int(whole), where
            min_p = mode.startswith("sample") and any(
                p.get("min_p") and p.get("temperature", 1.0) for p in _params(case))
            # a pair exchange (greedy logprobs: the scores' first exchange), the
            # row maxima for min_p, the scores' two exchanges
            base = {"greedy": 1, "logprobs": 2, "sample": 1, "sample_logprobs": 3}
            cut = mode.startswith("sample") and any(_truncates(p) for p in _params(case))
            assert r["calls"] == base[mode] + min_p + cut + gathers, where
        else:  # vLLM's path, the note saying why
            assert r["notes"][-1].startswith("vLLM ("), where
            assert mode in r["notes"][-1], where
            assert gathers == 1, where
        ours, theirs = r["logprobs"], r["vllm_logprobs"]
        assert (ours is None) == (theirs is None), where
        if ours is not None:
            assert ours[0] == theirs[0] and ours[2] == theirs[2], where
            # V2's rank kernel under Triton's interpreter miscounts bf16 logits:
            # raw bf16 ranks against torch's count, the rest against V2's
            scored_bf16 = case["dtype"] == "bfloat16" and not (case.get(
                "logprobs_mode", "raw").startswith("processed") and _processed(case))
            # (a row scored whole is V2's own compute_topk_scores: its count)
            assert all(o in ((t, g) if scored_bf16 else (t,)) for o, t, g in zip(
                ours[1], theirs[1], r["ranks"], strict=True)), where
            assert r["score_diff"] <= score_ulps(case), (where, r["score_diff"])
    return counts


def _truncates(p: dict) -> bool:
    """Whether V2 applies top-k / top-p to a request with these parameters (the cut's
    bounds cost one all-gather; vLLM turns both off for a greedy request)."""
    return p.get("temperature", 1.0) != 0.0 and (
        p.get("top_k", 0) not in (0, -1) or p.get("top_p", 1.0) != 1.0)


def _params(case) -> list[dict]:
    return case.get("row_params") or [case.get("params", {})]


def _processed(case) -> bool:
    """Whether V2 processes the step's logits (a float32 copy: its processed_logits)."""
    return any(p.get("temperature", 1.0) not in (0.0, 1.0) and p.get("temperature", 1.0)
               or p.get("min_p") and p.get("temperature", 1.0)
               or _penalized(p) or p.get("logit_bias") or p.get("allowed_token_ids")
               or p.get("min_tokens") for p in _params(case))


def _penalized(p: dict) -> bool:
    return any(p.get(k, d) != d for k, d in (
        ("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)))


def mode_of(rows: list[dict]) -> str:
    """The mode commfold.vllm.target.decision.decide_v2 gives these requests' step."""
    logprobs = any(p.get("logprobs") is not None for p in rows)
    if any(_penalized(p) or p.get("logit_bias") or p.get("allowed_token_ids")
           for p in rows) or any(p.get("temperature", 1.0) != 0.0 for p in rows):
        return "sample_logprobs" if logprobs else "sample"
    return "logprobs" if logprobs else "greedy"
