"""Softmax-family readers local_softmax_stats must leave alone (a consumer needs the
full row): it records why, the full gather still runs, results are unchanged. And
softmax(...).argmax(), which it does take: the same tokens with 3 values per row.
The other readers that need the full row (log_softmax kept whole, cumsum of probs)
are recognizer near-misses asserted without ranks in test_recognize_picks.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import commfold
from commfold.distributed.comm_log import record_collectives

from harness.gathers import all_gather_last_dim


def _gather(x):
    return all_gather_last_dim(x)


def entropy(x):  # a row statistic commfold does not combine
    full = _gather(x)
    return -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)


def softmax_argmax(x):
    return torch.softmax(_gather(x), -1).argmax(-1)


CASES = {entropy: "needs the full row", softmax_argmax: None}


def run_case(name: str, backend="commfold") -> dict:
    fn = next(f for f in CASES if f.__name__ == name)
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(4, 64)
    full[1, 5] = full[1, 40] = 9.0  # a tie across ranks: first index wins
    x = full.chunk(dist.get_world_size(), -1)[rank].contiguous()
    commfold.clear_reports()
    compiled = torch.compile(fn, backend=backend)
    got = compiled(x)
    with record_collectives() as log:
        compiled(x)
    plain = torch.compile(fn, backend="inductor")(x)
    report = commfold.last_report()
    return {"same": torch.equal(got, plain), "rewrites": report.count("local_softmax_stats"),
            "reasons": [m.reason for m in report.near_misses
                        if m.pass_name == "local_softmax_stats"],
            "gather_elements": log.elements("all_gather"), "fingerprint": report.fingerprint()}


@pytest.mark.parametrize("fn", list(CASES), ids=lambda f: f.__name__)
def test_skipped_with_reason_or_taken(ranks2, fn):
    results = ranks2.run(run_case, fn.__name__)
    for res in results:
        assert res["same"]
        want = CASES[fn]
        if want is None:  # taken: (max, sum, argmax) per row per rank
            assert res["rewrites"] == 1 and res["reasons"] == []
            assert res["gather_elements"] == 4 * 3
        else:
            assert res["rewrites"] == 0
            assert res["gather_elements"] == 4 * 32  # the full shard still travels
            assert len(res["reasons"]) == 1 and want in res["reasons"][0], res["reasons"]
    assert results[0]["fingerprint"] == results[1]["fingerprint"]


def faulty_surgery() -> dict:
    """A fault midway through the pass's graph surgery: the compile still works, the
    result is plain Inductor's, the report names the failed pass."""
    import commfold.passes.local_softmax_stats as mod

    real, calls = mod.insert_call, [0]

    def insert_call(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected fault")
        return real(*a, **k)

    mod.insert_call = insert_call
    try:
        # a fresh config: no cached graph skips the passes
        out = run_case("softmax_argmax", commfold.backend(extra=(("nonce", "fault"),)))
    finally:
        mod.insert_call = real
    report = commfold.last_report()
    return {"same": out["same"], "errors": [(e.pass_name, e.error) for e in report.errors],
            "gather_elements": out["gather_elements"]}


def test_fault_in_surgery_leaves_program_unchanged(ranks2):
    for res in ranks2.run(faulty_surgery):
        assert res["same"]
        assert res["gather_elements"] == 4 * 32  # undone: the full gather runs
        assert len(res["errors"]) == 1 and res["errors"][0][0] == "local_softmax_stats"
        assert "injected fault" in res["errors"][0][1]
