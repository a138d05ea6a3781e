"""Differential fuzzing: random tensor-parallel programs (harness/fuzz_programs.py) run
on 2 gloo ranks, compiled with commfold and with plain Inductor. Greedy tokens,
max values and embeddings must be bit-equal, norms within 1e-5 (f32) / 2^-7 (bf16)
relative, new residuals bit-equal; every rewrite site is rewritten exactly once, every
distractor is left alone (with a near-miss where its pass promises one), no pass
error, and the ranks' decision fingerprints agree.

The default run has two fixed programs that cover every spelling, plus one batch
of three distinct drawn programs (the same every run); the long fuzz (`slow`:
`python -m pytest -n 0 -m slow tests/test_fuzz.py`) runs fresh random batches of larger programs,
COMMFOLD_FUZZ_PROGRAMS of them in all (default 1002). Every batch is one rank-pool
call, and each program is compiled once per backend.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from harness import fuzz_programs as fp
from harness.draws import drawn

PER_BATCH, BLOCKS = 3, (2, 4)  # programs per batch (one rank-pool call), blocks per program
LONG_PER_BATCH, LONG_BLOCKS = 6, (3, 7)
LONG_PROGRAMS = int(os.environ.get("COMMFOLD_FUZZ_PROGRAMS", "1002"))

G = dict(kind="greedy", bad=None, seed=1, gather="funcol", dtype="f32", rows=3, vs=5, pad=1,
         ops=["scale", "div"], pick="argmax", ties=True)


def _norm(coll, norm, dtype, residual, reduce="sum", seed=2, scale=None, broadcast=None):
    return dict(kind="norm", seed=seed, coll=coll, norm=norm, dtype=dtype, tokens=3,
                hidden=16, residual=residual, eps=1e-6, reduce=reduce, scale=scale,
                broadcast=broadcast)


# Every spelling at least once, every distractor at least once (fixed: always run).
COVERAGE = [
    [G, dict(G, gather="inplace", pick="max", dtype="bf16", ops=["div"]),
     dict(G, gather="dtensor", pick="topk", ties=False, pad=0, ops=["add"]),
     dict(G, gather="funcol", pick="topk3", ties=False, dtype="f32", ops=["div"]),
     dict(G, gather="inplace", pick="logprob", dtype="bf16", ops=["add"]),
     # soft caps: left alone on CPU, each with its near-miss
     dict(G, gather="inplace", pick="topk3", ties=False, vs=17, pad=2, ops=["softcap"]),
     dict(G, gather="dtensor", pick="max", dtype="bf16", ops=["scale", "softcap"]),
     _norm("funcol", "hand", "f32", True), _norm("funcol_wait", "functional", "bf16", False),
     _norm("inplace", "gemma", "bf16", True), _norm("dtensor", "hand", "f32", True),
     _norm("inplace", "functional", "bf16", True, scale=0.22),
     _norm("dtensor", "gemma", "f32", False, scale=("div", 3.0)),
     _norm("inplace", "gemma", "bf16", False, scale=("itensor", 45.25)),
     # a hook's [T, H] all-reduce added to a [1, T, H] residual stream, and the reverse
     _norm("inplace", "hand", "bf16", True, broadcast="res1"),
     _norm("funcol", "functional", "f32", True, scale=0.22, broadcast="unsqueeze"),
     _norm("dtensor", "gemma", "bf16", True, broadcast="x1"),
     dict(kind="embed", seed=3, vocab=11, hidden=4, ids=(2, 3), spelling="masked_fill",
          coll="funcol"),
     dict(kind="embed", seed=4, vocab=7, hidden=8, ids=(1, 5), spelling="where", coll="inplace"),
     dict(kind="lm_head", seed=5, vocab=13, hidden=8, rows=2, coll="funcol"),
     dict(kind="lm_head", seed=6, vocab=20, hidden=16, rows=3, coll="inplace")],
    [dict(G, bad=bad, ops=[], ties=False, gather="inplace" if i % 2 else "funcol")
     for i, bad in enumerate(["neg_scale", "abs", "sin", "rsub", "second_consumer",
                              "rows_gather", "topk_smallest"])]
    + [_norm("funcol", "hand", "f32", True, "max"),
       _norm("dtensor", "functional", "f32", False, "avg"),
       _norm("inplace", "gemma", "bf16", True, "min"),
       _norm("funcol", "hand", "bf16", True, "max", scale=-1.5),
       G],  # and one good site among the distractors
]

# A hook's [T, H] all-reduce meeting a [1, T, H] residual stream in every spelling
# (the residual widened, the input widened, each view adding the leading 1 back), at 2
# and 4 ranks (test_broadcast_spellings).
BROADCAST = [_norm(coll, norm, dtype, True, seed=10 + i, broadcast=bc, scale=scale)
             for i, (coll, norm, dtype, bc, scale) in enumerate([
                 ("funcol", "hand", "bf16", "res1", None),
                 ("inplace", "functional", "f32", "x1", ("tensor", 0.22)),
                 ("dtensor", "gemma", "bf16", "unsqueeze", None),
                 ("funcol_wait", "hand", "f32", "reshape", 12.0),
                 ("inplace", "gemma", "f32", "view", None),
                 ("funcol", "functional", "bf16", "index", ("div", 3.0))])]

TALLY = {"programs": 0, "blocks": 0, "rewrites": 0, "distractors": 0}


def _run_batch(ranks2, programs, **run_kwargs):
    per_rank = ranks2.run(fp.run_programs, programs, **run_kwargs)
    problems = []
    for i, blocks in enumerate(programs):
        found = fp.check(blocks, [r[i] for r in per_rank])
        problems += [f"program {i}: {p}" for p in found]
        TALLY["programs"] += 1
        TALLY["blocks"] += len(blocks)
        TALLY["rewrites"] += sum(per_rank[0][i]["counts"].values())
        TALLY["distractors"] += sum(fp.is_distractor(b) for b in blocks)
    print(f"commfold fuzz: {TALLY['programs']} programs, {TALLY['blocks']} blocks, "
          f"{TALLY['rewrites']} rewrites checked, {TALLY['distractors']} distractors left alone")
    assert not problems, "\n".join(problems) + f"\nprograms: {programs}"


@pytest.mark.parametrize("i", range(len(COVERAGE)))
def test_every_spelling(ranks2, i):
    _run_batch(ranks2, [COVERAGE[i]])


@pytest.mark.parametrize("world", [2, 4])
def test_broadcast_spellings(ranks2, ranks4, world):
    """Every leading-1 broadcast spelling, and one drawn program whose norm blocks all
    broadcast (harness.draws: the same every run), at 2 and 4 ranks."""
    drawn_norms = drawn(st.lists(fp.norm_block.filter(
        lambda b: b["broadcast"] is not None and b["residual"]), min_size=2, max_size=3), 1)
    _run_batch({2: ranks2, 4: ranks4}[world], [BROADCAST, *drawn_norms])


def test_random_programs(ranks2):
    """One batch of PER_BATCH distinct drawn programs (harness.draws: the same ones every
    run, fresh ones with COMMFOLD_HYPOTHESIS=random), in one rank-pool call."""
    programs = drawn(fp.program(*BLOCKS), PER_BATCH)
    assert len(programs) == PER_BATCH
    _run_batch(ranks2, programs)


# the long fuzz: fresh random batches, LONG_PROGRAMS programs in all
@pytest.mark.slow
@settings(max_examples=-(-LONG_PROGRAMS // LONG_PER_BATCH), deadline=None, database=None,
          phases=[Phase.generate], derandomize=False, suppress_health_check=list(HealthCheck))
@given(programs=st.lists(fp.program(*LONG_BLOCKS), min_size=LONG_PER_BATCH,
                         max_size=LONG_PER_BATCH))
def test_random_programs_long(ranks2, programs):
    # it shares the machine for hours: a batch may wait on the CPU, not hang
    _run_batch(ranks2, programs, timeout=3600)
