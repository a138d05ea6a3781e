"""What every runnable example does around its model: compile it with stock Inductor
and with commfold, demand identical greedy tokens, and run as one rank (torchrun,
`commfold diff`) or spawn its own ranks."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import commfold


def greedy_vs_inductor(decode, model, ids) -> dict:
    """decode(step_fn, ids) with model compiled by stock Inductor and by commfold;
    raises if the tokens differ; returns this rank's tokens, report and counts."""
    with torch.no_grad():
        expected = decode(torch.compile(model, backend="inductor"), ids)
        commfold.clear_reports()
        tokens = decode(torch.compile(model, backend="commfold"), ids)
    if not torch.equal(tokens, expected):
        raise AssertionError(f"rank {dist.get_rank()}: commfold changed the greedy tokens:\n"
                             f"{tokens}\nvs stock Inductor\n{expected}")
    report = commfold.last_report()
    return {"rank": dist.get_rank(), "tokens": tokens.tolist(), "summary": report.summary(),
            "rewrites": {p: report.count(p) for p in commfold.ALL_PASSES}}


def show(results: list) -> None:
    print(results[0]["summary"])
    print("rewrites per pass, per rank:", [r["rewrites"] for r in results])
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    print(f"greedy tokens identical to stock Inductor on {len(results)} rank(s)"
          f"{', and across ranks' if same else ''}: {results[0]['tokens']}")
    if not same:
        raise SystemExit("ranks produced different tokens")


def run_example(main, world_size: int = 2) -> None:
    """Under torchrun / `commfold diff` (RANK set) this process is one rank; otherwise
    spawn world_size gloo ranks on this machine."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        show([main()])
        dist.destroy_process_group()
    else:
        from commfold.distributed.ranks import run_on_ranks

        show(run_on_ranks(main, world_size))
