"""Softmax-family readers local_softmax_stats must leave alone (a consumer needs the
full row): it records why, the full gather still runs, results are unchanged. And
softmax(...).argmax(), which it does take: the same tokens with 3 values per row."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfold
from commfold.testing import record_collectives


def _gather(x):
    return funcol.all_gather_tensor(x, -1, dist.group.WORLD)


def full_log_softmax(x):
    return torch.log_softmax(_gather(x), -1)


def cumulative_probs(x):  # top-p sampling reads the whole sorted row
    return torch.softmax(_gather(x), -1).cumsum(-1)


def entropy(x):  # a row statistic commfold does not combine
    full = _gather(x)
    return -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)


def softmax_argmax(x):
    return torch.softmax(_gather(x), -1).argmax(-1)


CASES = {full_log_softmax: "needs the full row", cumulative_probs: "needs the full row",
         entropy: "needs the full row", softmax_argmax: None}


def run_case(name: str) -> dict:
    fn = next(f for f in CASES if f.__name__ == name)
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(4, 64)
    full[1, 5] = full[1, 40] = 9.0  # a tie across ranks: first index wins
    x = full.chunk(dist.get_world_size(), -1)[rank].contiguous()
    commfold.clear_reports()
    compiled = torch.compile(fn, backend="commfold")
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
