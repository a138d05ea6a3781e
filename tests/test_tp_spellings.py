"""The corpus of hand-written tensor-parallel spellings (harness/tp_spellings.py), each
compiled with backend="commfold" on 2 real gloo ranks: fused (one rewrite, the graph's
one all-reduce all that runs, the new residual bit-exact and the norm within
docs/GUARANTEES.md's tolerances of the unrewritten program), or left unfused with the
near-miss that names its blocker (outputs then equal the unrewritten program's, and
`commfold diff`'s summary prints the reason with the user's source line).

CASES is the one table: docs/passes.md's "Hand-written TP spellings" table is checked
against it (test_docs_table_matches_the_corpus), and the rank test checks it against
what commfold does. All cases run in one rank-pool call.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import commfold
from commfold.distributed.comm_log import record_collectives

from harness import tp_spellings as tp

ROOT = Path(__file__).resolve().parent.parent
FUSED = "fused"

# name: (spelling as the docs show it, reduce, add, norm, dtype, expected result).
# The result is FUSED or the near-miss reason, with T standing for the symbolic token
# count (s0, s7, ...: its name depends on what was traced before).
CASES: dict[str, tuple[str, str, str, str, str, str]] = {
    "hook_ranklist": (
        "forward hook `funcol.all_reduce(output, \"sum\", list(range(ws)))`, `r + out`",
        "hook", "res_first", "typeas_before", "bf16", FUSED),
    "hook_batch0": (
        "hook all-reducing `output[0]` ([T, H]), `r + out` with r [1, T, H]",
        "hook_batch0", "res_first", "typeas_before", "bf16", FUSED),
    "hook_batch0_out_first": (
        "hook `output[0]`, `out + r`, norm `(n * w.float()).type_as(h)`",
        "hook_batch0", "out_first", "typeas_after", "f32", FUSED),
    "inplace_module": (
        "`dist.all_reduce(out)` inside the module, `r + out`",
        "inplace", "res_first", "to_before", "bf16", FUSED),
    "megatron_region": (
        "`reduce_from_tensor_model_parallel_region(out)` (autograd.Function), inference",
        "megatron", "out_first", "functional", "f32", FUSED),
    "dtensor_rowwise": (
        "DTensor `ColwiseParallel` + `RowwiseParallel(output_layouts=Replicate())`",
        "dtensor", "res_first", "typeas_before", "bf16", FUSED),
    "unsqueeze": (
        "hook `output[0]`, `out.unsqueeze(0) + r`",
        "hook_batch0", "unsqueeze", "typeas_before", "bf16", FUSED),
    "index_none": (
        "`r + out[None]` (out [T, H] from `dist.all_reduce`)",
        "inplace", "index_none", "functional", "f32", FUSED),
    "reshape": (
        "`out.reshape(1, -1, H) + r`",
        "inplace", "reshape", "typeas_after", "bf16", FUSED),
    "view_as_residual": (
        "hook `output[0]`, `r + out.view(r.shape)`",
        "hook_batch0", "view", "to_before", "f32", FUSED),
    "f32_stream": (
        "float32 residual stream, bf16 all-reduce: `r + out.float()`",
        "inplace", "f32_stream", "typeas_after", "bf16", "the residual is float32, not "
        "torch.bfloat16: a float32 residual stream (torch before 2.13 drops vLLM's cast back "
        "to the model's dtype, or the model keeps its residual in float32); the fused op "
        "keeps the residual in the model's dtype"),
    "f32_stream_batch0": (
        "hook `output[0]` (bf16 [T, H]), `r + out.float()` with r float32 [1, T, H]",
        "hook_batch0", "f32_stream", "typeas_before", "bf16", "the residual is float32, not "
        "torch.bfloat16: a float32 residual stream (torch before 2.13 drops vLLM's cast back "
        "to the model's dtype, or the model keeps its residual in float32); the fused op "
        "keeps the residual in the model's dtype"),
    "mixed_dtypes": (
        "`out + r`, out bf16, r float32 (promoted, no cast)",
        "inplace", "mixed", "functional", "bf16",
        "aten.add.Tensor adds the all-reduce's torch.bfloat16 [1, T, 48] to a "
        "torch.float32 operand: dtypes differ (the fused op adds in the all-reduce's dtype)"),
    "true_broadcast": (
        "hook `output[0]` + a [2, T, H] residual (a true broadcast)",
        "hook_batch0", "repeat", "typeas_before", "f32",
        "aten.add.Tensor broadcasts the all-reduce's [T, 48] against [2, T, 48]: its "
        "elements would be repeated"),
    "view_mid": (
        "`out.reshape(-1, 1, H) + r` with r [T, 1, H]",
        "inplace", "view_mid", "typeas_before", "f32",
        "aten.reshape.default views the all-reduce's [T, 48] as [T, 1, 48]: not only "
        "leading size-1 dims added or removed before a residual add"),
    "also_read": (
        "`out + r`, and `out` also returned",
        "inplace", "also_read", "typeas_before", "bf16",
        "the reduced value is read besides the residual add (the op returns only the sum "
        "with the residual)"),
    "scaled_also_read": (
        "`out * 0.5 + r`, and `out` also returned",
        "inplace", "scaled_also_read", "functional", "f32",
        "the reduced value is read besides its scale (the op returns the scaled value)"),
    "max_reduce": (
        "`dist.all_reduce(out, op=MAX)`",
        "max", "res_first", "typeas_before", "f32",
        "'max' all-reduce (only a sum can be fused with the add)"),
}


def _pattern(expected: str) -> str:
    """The reason as a regex: T in a shape matches the symbolic size."""
    parts = re.split(r"(?<=\[)T(?=[,\]])|(?<=, )T(?=[,\]])", expected)
    return r"s\d+".join(re.escape(p) for p in parts)


def corpus_on_rank(names, tokens=5):
    """The corpus as one module (one compile per backend, T dynamic, for inference):
    per case, the unrewritten program's (plain Inductor) outputs against commfold's,
    and the decisions whose source location names the case's tail."""
    specs = {n: CASES[n][1:5] for n in names}
    model = tp.Corpus(specs)
    args = tp.corpus_inputs(specs, tokens, dist.get_rank())
    with torch.no_grad():
        torch._dynamo.reset()
        want = torch.compile(lambda *a: model(*a), backend="inductor")(*args)
        torch._dynamo.reset()
        commfold.clear_reports()
        fused = torch.compile(lambda *a: model(*a),
                              backend=commfold.backend(passes=("fuse_allreduce_rmsnorm",),
                                                       fuse_cost_rule=False))
        with record_collectives() as log:
            got = fused(*args)
    reports = commfold.reports()
    out = dict(all_reduces=log.calls("all_reduce"), calls=log.calls(),
               errors=[e.error for rep in reports for e in rep.errors],
               unplaced=[], summary=summary(reports))
    for name, g, w in zip(names, got, want):
        u, f = w[0].double(), g[0].double()
        out[name] = dict(
            fused=0, misses=[], shapes=[tuple(t.shape) for t in g],
            want_shapes=[tuple(t.shape) for t in w], res_equal=torch.equal(g[1], w[1]),
            rest_equal=all(torch.equal(a, b) for a, b in zip(g[2:], w[2:])),
            rel_diff=((f - u).abs() / u.abs().clamp_min(1e-3)).max().item())
    for rep in reports:
        for item, key in [*((r, "fused") for r in rep.rewrites),
                          *((m, "misses") for m in rep.near_misses)]:
            case = re.search(r"\btails\.(\w+)", item.location)
            if case is None or case[1] not in out:
                out["unplaced"].append(item)
            elif key == "fused":
                out[case[1]]["fused"] += 1
            else:
                out[case[1]]["misses"].append(item.reason)
    return out


def summary(reports) -> str:
    """`commfold diff`'s summary of these reports (its table and near-miss lines)."""
    from commfold.cli.diff.summary import summary as diff_summary

    graphs = [dict(graph=rep.graph_index, rewrites=[vars(r) | dict(
        comm_before=vars(r.comm_before), comm_after=vars(r.comm_after)) for r in rep.rewrites],
        errors=[vars(e) for e in rep.errors], near_misses=[vars(m) for m in rep.near_misses],
        fingerprint=rep.fingerprint()) for rep in reports]
    return diff_summary([graphs], Path("dumps"))


TOLERANCE = {"f32": 1e-5, "bf16": 2 ** -7}  # docs/GUARANTEES.md, relative


@pytest.mark.ranks
def test_every_spelling_is_fused_or_explained(ranks2):
    # one call compiles the whole corpus twice: minutes on a loaded 2-core machine
    per_rank = ranks2.run(corpus_on_rank, list(CASES), timeout=1800)
    problems = []
    for rank, results in enumerate(per_rank):
        if results["errors"] or results["unplaced"] or results["calls"] != len(CASES) \
                or results["all_reduces"] != len(CASES):
            problems.append(f"rank {rank}: {results}")
        lines = results["summary"].splitlines()
        for name, (_, _, _, _, dtype, expected) in CASES.items():
            res = results[name]
            if res["shapes"] != res["want_shapes"] or not res["res_equal"] \
                    or not res["rest_equal"] or res["rel_diff"] > TOLERANCE[dtype]:
                problems.append(f"rank {rank} {name} (numerics): {res}")
            if expected == FUSED:
                if res["fused"] != 1 or res["misses"]:
                    problems.append(f"rank {rank} {name} (want fused): {res}")
                continue
            if res["fused"] or len(res["misses"]) != 1 or res["rel_diff"] != 0 \
                    or not re.fullmatch(_pattern(expected), res["misses"][0]):
                problems.append(f"rank {rank} {name} (want {expected!r}): {res}")
                continue
            # commfold diff's summary: the reason at the tail's source line, then its code
            at = [i for i, ln in enumerate(lines) if res["misses"][0] in ln
                  and re.search(rf"\btails\.{name}[.:]", ln)]
            if len(at) != 1 or "tp_spellings.py:" not in lines[at[0]] \
                    or not lines[at[0] + 1].lstrip().startswith("| "):
                problems.append(f"rank {rank} {name}: summary {results['summary']}")
    assert not problems, "\n".join(problems)
    # every rank decided the same (a rank that fused alone would hang its peers)
    decided = [{n: (r[n]["fused"], r[n]["misses"]) for n in CASES} for r in per_rank]
    assert decided == [decided[0]] * len(per_rank)


# ---- docs/passes.md's table is this one -------------------------------------------

DOC = ROOT / "docs" / "passes.md"
BEGIN, END = "<!-- tp-spellings: begin -->", "<!-- tp-spellings: end -->"


def docs_table() -> str:
    """The table docs/passes.md holds between its markers, from CASES."""
    rows = ["| spelling | dtype | result |", "|---|---|---|"]
    for spelling, _, _, _, dtype, expected in CASES.values():
        result = "fused" if expected == FUSED else f'near-miss: "{expected}"'
        rows.append(f"| {spelling} | {dtype} | {result} |")
    return "\n".join(rows)


def test_docs_table_matches_the_corpus():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lacks the corpus table's markers"
    held = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert held == docs_table(), (
        "docs/passes.md's TP spellings table differs from tests/test_tp_spellings.py's "
        "CASES; the table as CASES gives it:\n" + docs_table())
