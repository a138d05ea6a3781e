"""Canonicalization, the manager's step before the passes (commfold.canonicalize):
value-preserving rewrites recorded in the report when they changed something, never
in the decision fingerprint, and a failing step leaves the graph as it came (strict
raises).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import commfold
from commfold import canonicalize
from commfold.report import Report
from harness.post_grad import post_grad

FOLDED = "slice read-backs folded"


def scaled_in_place(x):
    """vLLM's LogitsProcessor spelling: a slice of the row scaled in place, read back."""
    y = x * 1
    y[:, :5] *= 0.5
    return y[:, :5].argmax(-1), y[:, :5].sum(-1)


def _targets(graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_read_backs_folded_and_recorded():
    graph = post_grad(scaled_in_place, torch.randn(3, 8))
    assert torch.ops.aten.slice_scatter.default in _targets(graph)
    commfold.CommfoldPass(commfold.Config(passes=("local_argmax",)))(graph)
    rep = commfold.last_report()
    assert rep.canonicalized.get(FOLDED, 0) >= 1 and not rep.errors, rep.summary()
    assert torch.ops.aten.slice_scatter.default not in _targets(graph)  # nothing reads it
    assert f"canonicalized before the passes: {rep.canonicalized[FOLDED]} {FOLDED}" \
        in rep.summary()
    assert Report.from_dict(rep.to_dict()) == rep
    # not a decision: the fingerprint is the passes' decisions only
    assert dataclasses.replace(rep, canonicalized={}).fingerprint() == rep.fingerprint()


def test_nothing_to_canonicalize_records_nothing():
    graph = post_grad(lambda x: (x * 2).argmax(-1), torch.randn(3, 8))
    commfold.CommfoldPass(commfold.Config(passes=("local_argmax",)))(graph)
    rep = commfold.last_report()
    assert rep.canonicalized == {} and "canonicalized" not in rep.summary()


def test_compiled_results_unchanged():
    """Bit-equal to plain Inductor's program after canonicalization, in a real compile."""
    x = torch.randn(4, 8)
    backend = commfold.backend(passes=("local_argmax",), extra=(("test_nonce", "canon"),))
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        want = torch.compile(scaled_in_place, backend="inductor")(x.clone())
        torch._dynamo.reset()
        got = torch.compile(scaled_in_place, backend=backend)(x.clone())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert commfold.last_report().canonicalized.get(FOLDED, 0) >= 1


def test_failing_step_leaves_the_graph_as_it_came(monkeypatch):
    def breaks(graph):
        canonicalize.fold_readbacks(graph)  # changes the graph, then fails
        raise RuntimeError("broken step")

    monkeypatch.setattr(canonicalize, "STEPS", ((FOLDED, breaks),))
    graph = post_grad(scaled_in_place, torch.randn(3, 8))
    before = _targets(graph)
    commfold.CommfoldPass(commfold.Config(passes=("local_argmax",)))(graph)
    rep = commfold.last_report()
    assert [(e.pass_name, e.error) for e in rep.errors] == \
        [("canonicalize", "RuntimeError: broken step")]
    assert rep.canonicalized == {} and _targets(graph) == before
    with pytest.raises(RuntimeError, match="broken step"):
        commfold.CommfoldPass(commfold.Config(passes=("local_argmax",), strict=True))(
            post_grad(scaled_in_place, torch.randn(3, 8)))
