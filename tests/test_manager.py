"""The pass manager never breaks a compile: a pass that fails midway leaves the graph
exactly as it was, warns, and records the error; strict=True raises instead."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import commfold
from commfold.distributed.comm_log import record_collectives

from harness.gathers import all_gather_last_dim


def greedy(x):
    return all_gather_last_dim(x).argmax(-1)


BROKEN = "used before it has been defined"  # FX's lint


def failing_pass_program(strict: bool, dangling: bool = False) -> dict:
    import commfold.passes as passes

    real = passes.PASSES["local_argmax"]

    def rewrite_then_fail(ctx):
        if dangling:  # an edit with no rewrite recorded, that leaves a broken graph
            pick = next(n for n in ctx.graph.nodes if n.op == "output").args[0][0]
            gone = ctx.graph.call_function(torch.ops.aten.clone.default, (pick.args[0],))
            ctx.graph.erase_node(gone)
            pick.replace_input_with(pick.args[0], gone)
            return
        real(ctx)  # graph surgery really happens...
        raise RuntimeError("injected failure")  # ...then the pass dies

    passes.PASSES["local_argmax"] = rewrite_then_fail
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("commfold").addHandler(handler)
    # the swapped pass is not in the cache key: compile afresh
    try:
        torch._dynamo.reset()
        x = torch.randn(3, 40) + dist.get_rank()
        fn = torch.compile(greedy, backend=commfold.backend(strict=strict))
        with torch._inductor.config.patch(fx_graph_cache=False):
            try:
                got = fn(x)
            except Exception as e:  # strict mode
                return {"raised": (BROKEN if dangling else "injected failure")
                        in str(e)}
            with record_collectives() as log:
                fn(x)
        report = commfold.last_report()
        return {"raised": False, "same": torch.equal(got, greedy(x)),
                "errors": [e.error for e in report.errors], "rewrites": len(report.rewrites),
                "gather_elements": log.elements("all_gather"),
                "warned": any((BROKEN if dangling else "injected failure")
                              in r.getMessage() for r in records)}
    finally:
        passes.PASSES["local_argmax"] = real
        logging.getLogger("commfold").removeHandler(handler)


def test_failing_pass_leaves_graph_unchanged(ranks2):
    for res in ranks2.run(failing_pass_program, False):
        assert res["same"] and res["warned"] and res["rewrites"] == 0
        assert res["errors"] == ["RuntimeError: injected failure"]
        assert res["gather_elements"] == 3 * 40  # the original full gather runs


def test_a_pass_that_breaks_the_graph_without_a_rewrite_is_rolled_back(ranks2):
    for res in ranks2.run(failing_pass_program, False, True):
        assert res["same"] and res["warned"] and res["rewrites"] == 0
        assert len(res["errors"]) == 1 and BROKEN in res["errors"][0]
        assert res["gather_elements"] == 3 * 40


def test_strict_raises(ranks2):
    assert ranks2.run(failing_pass_program, True) == [{"raised": True}] * 2


def test_a_swapped_pass_is_not_served_the_cached_graph(monkeypatch):
    """The cache key names the function behind each pass: a pass replaced at run time
    (here, as test_bench and the test above do) gets its own Inductor cache entry."""
    import commfold.passes as passes
    from commfold.manager import CommfoldPass

    before = CommfoldPass().uuid()
    monkeypatch.setitem(passes.PASSES, "local_argmax", lambda ctx: None)
    assert CommfoldPass().uuid() != before
    monkeypatch.undo()
    assert CommfoldPass().uuid() == before
