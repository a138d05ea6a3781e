"""Shapes local_argmax must leave alone: it records why (a near-miss), the full
gather still runs, and the tokens are the eager program's. End to end on ranks for one
near-miss and one gather that is no vocab gather; every near-miss reason of the greedy
recognizer is asserted without ranks in test_recognize_picks.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfold
from commfold.distributed.comm_log import record_collectives

from harness.gathers import all_gather_last_dim


def _gather(x):
    return all_gather_last_dim(x)


def second_consumer(x, t):
    full = _gather(x)
    return full.argmax(-1), full[:, :3] * 2  # exact in any order


def rows_gather(x, t):
    return funcol.all_gather_tensor(x, 0, dist.group.WORLD).argmax(-1)


def soft_capped(x, t):  # Gemma's final soft cap: its tanh is Sleef's or libm's on CPU
    return (torch.tanh(_gather(x) / 30.0) * 30.0).argmax(-1)


CASES = {
    second_consumer: "other consumers",
    soft_capped: "tanh on the logits",
    rows_gather: None,  # a gather of rows is no vocab gather: no rewrite, no record
}


def run_skip(name: str) -> dict:
    fn = next(f for f in CASES if f.__name__ == name)
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(4, 64)
    x = full.chunk(dist.get_world_size(), -1)[rank].contiguous()
    t = torch.tensor(0.5)
    commfold.clear_reports()
    compiled = torch.compile(fn, backend="commfold")
    got = compiled(x, t)
    with record_collectives() as log:
        compiled(x, t)
    want = fn(x, t)
    report = commfold.last_report()
    same = all(torch.equal(a, b) for a, b in zip(
        got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)))
    return {"same": same, "rewrites": report.count("local_argmax"),
            "reasons": [m.reason for m in report.near_misses if m.pass_name == "local_argmax"],
            "gather_elements": log.elements("all_gather"), "fingerprint": report.fingerprint()}


@pytest.mark.parametrize("fn", list(CASES), ids=lambda f: f.__name__)
def test_skipped_with_reason(ranks2, fn):
    results = ranks2.run(run_skip, fn.__name__)
    for res in results:
        assert res["same"]
        assert res["rewrites"] == 0
        assert res["gather_elements"] == 4 * 32  # the full shard still travels
        want = CASES[fn]
        if want is None:
            assert res["reasons"] == []
        else:
            assert len(res["reasons"]) == 1 and want in res["reasons"][0], res["reasons"]
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
