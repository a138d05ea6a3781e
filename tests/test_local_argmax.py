"""local_argmax on real gloo ranks: same tokens as the unrewritten program (eager) and
the full-logits reference, the full-vocab gather gone from the collectives that ran,
decisions rank-consistent. The edge-row kinds also run plain Inductor's compile of the
unrewritten program (its fused bf16 chain rounds unlike eager); the random draws leave
it out: it checks torch, not commfold, and costs as much as commfold's own compile.

topk(1) is compared with argmax's first-max rule: torch.topk's choice among equal
values is unspecified (on CPU it varies with the row length); commfold picks the
lowest index, and says so in the README.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

import commfold
from commfold.torch_compat import torch_version
from commfold.distributed.comm_log import record_collectives

from harness.draws import drawn
from harness.argmax_programs import PROGRAMS, funcol_max_values, reference, setup_mesh
from harness.logit_cases import DTYPES, make_logits
from harness.gathers import all_gather_last_dim

SPECIALS = ("normal", "ties", "nan", "inf", "neginf_row", "boundary_tie", "padding_bait")


case_st = st.fixed_dictionaries({
    "rows": st.integers(1, 9),
    "vocab": st.integers(2, 700),
    "seed": st.integers(0, 2**31 - 1),
    "special": st.sampled_from(SPECIALS),
})
TEMP = 0.7  # fixed: a temperature that changes between compiles becomes a symbolic
            # float whose sign is unknown, and commfold then (rightly) skips

_compiled: dict = {}


def _compile(name, vocab, temp, backend):
    key = (name, vocab, temp, backend)
    if key not in _compiled:
        fn = PROGRAMS[name]
        _compiled[key] = torch.compile(lambda s: fn(s, vocab, temp), backend=backend)
    return _compiled[key]


def check_program(name: str, dtype_name: str, cases: list[dict],
                  with_inductor: bool = False) -> dict:
    """Rank body: for each case compare commfold, eager (and plain Inductor when asked)
    with the full-logits reference; log what was gathered."""
    torch._dynamo.config.cache_size_limit = 512
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    world, rank = dist.get_world_size(), dist.get_rank()
    setup_mesh()
    dtype = DTYPES[dtype_name]
    mismatches, gathered, fingerprints = [], [], []
    for case in cases:
        case = dict(case, dtype=dtype)
        if name.startswith("funcol") and case["rows"] == 1:
            case["rows"] = 2  # torch 2.13's funcol gather on dim -1 fails for 1 row, eager too
        logits, vocab = make_logits(case, world)
        vs = logits.shape[1] // world
        shard = logits[:, rank * vs:(rank + 1) * vs].contiguous()
        temp = TEMP
        expect = reference(logits, vocab, temp, name)
        runs = [("eager", PROGRAMS[name](shard, vocab, temp))]
        if with_inductor:
            runs.append(("inductor", _compile(name, vocab, temp, "inductor")(shard)))
        seen = len(commfold.reports())
        ours_fn = _compile(name, vocab, temp, "commfold")
        ours = ours_fn(shard)
        # empty when dynamo reused a (symbolic-vocab / symbolic-rows) compile
        fingerprints += [r.fingerprint() for r in commfold.reports()[seen:]]
        with record_collectives() as log:
            again = ours_fn(shard)
        gathered.append((case["rows"], [e.elements for e in log.of("all_gather")]))
        for label, got in runs + [("commfold", ours), ("commfold-2nd", again)]:
            want = expect
            if label in ("eager", "inductor") and name == "dtensor_topk":
                # torch.topk may return any of several tied maxima: check it picked one
                got, want = picked_value(logits, vocab, got), picked_value(logits, vocab, expect)
            elif label.startswith("commfold") and dtype != torch.float32:
                # eager rounds bf16/fp16 after every op (ties may appear), Inductor keeps
                # a fused chain in f32: the first max under either rounding is right
                alt = reference(logits.float(), vocab, temp, name)
                want = torch.where(got == alt, alt, expect)
            if not torch.equal(got, want):
                mismatches.append((label, {k: v for k, v in case.items() if k != "dtype"},
                                   got.tolist(), expect.tolist()))
    return {"mismatches": mismatches, "gathered": gathered,
            "fingerprints": fingerprints,
            "reports": [r.summary() for r in commfold.reports()[-3:]]}


def picked_value(logits, vocab, index):
    """The scaled logits dtensor_topk compares, at the chosen indices, NaN made
    comparable (NaN == NaN)."""
    scaled = logits[:, :vocab] / TEMP * 2.0
    v = scaled.double().gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return torch.where(v.isnan(), torch.full_like(v, 1e300), v)


def _run(pool, name, dtype_name, cases, with_inductor=False):
    results = pool.run(check_program, name, dtype_name, cases, with_inductor)
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}: {res['mismatches'][:3]}"
        # the rewrite happened: commfold's run sends one (value, index) pair per row
        # per rank, and no full-vocab gather runs
        for rows, elems in res["gathered"]:
            assert elems == [rows * 2], (rows, elems, res["reports"])
    assert all(r["fingerprints"] == results[0]["fingerprints"] for r in results)
    return results


@pytest.mark.parametrize("name", sorted(set(PROGRAMS) - {"funcol_scaled_in_place"}))
# 2 draws: hypothesis's simplest case, then 2 random ones (each case compiles the
# program on every rank; COMMFOLD_HYPOTHESIS=random draws fresh ones each run)
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(case_st, min_size=2, max_size=2),
       dtype_name=st.sampled_from(sorted(DTYPES)))
def test_same_tokens_2_ranks(ranks2, name, cases, dtype_name):
    _run(ranks2, name, dtype_name, cases)


@pytest.mark.skipif(torch_version() < (2, 13), reason="torch < 2.13 has no "
                    "funcol.all_gather_single: the gather is spelled dim 0 + movedim + reshape "
                    "(a copy), and that copy scaled in place is not recognized (results unchanged)")
def test_logits_scaled_in_place(ranks2):
    """vLLM's LogitsProcessor spelling, `full[:, :vocab] *= 1 / T`: functionalized, the
    row is read back from a slice_scatter; the pick is still local (one fixed case:
    the spelling, not the values, is what is new; vLLM's own processor in
    test_vllm_top_tokens.py)."""
    _run(ranks2, "funcol_scaled_in_place", "f32",
         [{"rows": 4, "vocab": 301, "seed": 5, "special": "ties"}])


# past hypothesis's simplest case, with a shard of real columns on each of 4 ranks
case_4_ranks_st = case_st.filter(lambda c: c["seed"] > 0 and c["vocab"] > 8)


@pytest.mark.parametrize("name", ["funcol_argmax", "inplace_max"])
def test_same_tokens_4_ranks(ranks4, name):
    """One drawn case per program and dtype (harness.draws: past the simplest)."""
    case, dtype_name = drawn(st.tuples(case_4_ranks_st, st.sampled_from(sorted(DTYPES))), 1,
                             salt=len(name))[0]
    _run(ranks4, name, dtype_name, [case])


@pytest.mark.parametrize("special", SPECIALS)
def test_every_edge_row_kind_bf16(ranks2, special):
    """Each special row kind at least once, deterministic, in bf16 (most ties)."""
    cases = [{"rows": 5, "vocab": 301, "seed": 7, "special": special}]
    _run(ranks2, "funcol_argmax", "bf16", cases, with_inductor=True)


def values_and_indices() -> dict:
    """max(dim=-1, keepdim=True) with both outputs used: values and ids both exact."""
    world, rank = dist.get_world_size(), dist.get_rank()
    case = {"rows": 6, "vocab": 99, "seed": 3, "special": "nan", "dtype": torch.float32}
    logits, vocab = make_logits(case, world)
    vs = logits.shape[1] // world
    shard = logits[:, rank * vs:(rank + 1) * vs].contiguous()
    commfold.clear_reports()
    v, i = torch.compile(lambda s: funcol_max_values(s, vocab, 1.0), backend="commfold")(shard)
    ev, ei = logits[:, :vocab].max(dim=-1, keepdim=True)
    report = commfold.last_report()
    return {"values": torch.equal(v, ev) or bool(((v == ev) | (v.isnan() & ev.isnan())).all()),
            "indices": torch.equal(i, ei), "rewrites": report.count("local_argmax"),
            "where": [r.location for r in report.rewrites if r.pass_name == "local_argmax"]}


def test_max_values_and_indices(ranks2):
    import inspect

    from harness import argmax_programs
    line = inspect.getsource(argmax_programs).splitlines().index(
        "    v, i = full[:, :vocab].max(dim=-1, keepdim=True)") + 1
    for res in ranks2.run(values_and_indices):
        # the report names the user's line that made the pick
        assert res == {"values": True, "indices": True, "rewrites": 1,
                       "where": [f"harness/argmax_programs.py:{line} (funcol_max_values)"]}


def index_above_2_24() -> int:
    """Vocab of 2^24 + 8: the winner's index is not representable in float32."""

    world, rank = dist.get_world_size(), dist.get_rank()
    vocab = 2**24 + 8
    vs = -(-vocab // world)
    shard = torch.zeros(2, vs)
    winner = 2**24 + 1
    if rank * vs <= winner < (rank + 1) * vs:
        shard[:, winner - rank * vs] = 1.0
    # 2 rows: torch 2.13's dynamo mis-traces the gather of a [1, 2^23] shard (eager is fine)
    fn = torch.compile(
        lambda s: all_gather_last_dim(s)[:, :vocab].argmax(-1),
        backend="commfold")
    return int(fn(shard)[0])


def test_index_above_2_24(ranks2):
    assert ranks2.run(index_above_2_24) == [2**24 + 1] * 2
