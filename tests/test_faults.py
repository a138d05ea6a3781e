"""Faults and awkward graphs: commfold never breaks a compile and never changes a
result.

- An exception injected inside each pass (midway through its graph surgery: the
  second node it inserts) and inside each recognizer a pass calls (monkeypatched in
  the rank process): the compile succeeds, every output equals plain Inductor's, the
  failing pass's rewrites are undone (the other passes still rewrite: the graph
  commfold hands on is the one it makes with the failing passes left out), a warning on
  logger "commfold" and a report.errors entry name the pass and the error;
  strict=True raises instead.
- Dynamic shapes (symbolic batch), recompiles (new static shapes), in-place ops on
  graph inputs (copy_ write-backs), an in-place custom op (auto_functionalized nodes)
  and empty batches (0 rows): results equal plain Inductor's.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import commfold
from commfold.torch_compat import torch_version
from harness import fuzz_programs as fp
from harness.gathers import all_gather_last_dim

LA, FUSE, REP, TOPK, STATS = fp.LA, fp.FUSE, fp.REP, fp.TOPK, fp.STATS
G = dict(kind="greedy", bad=None, seed=1, gather="funcol", dtype="f32", rows=3, vs=5, pad=1,
         ops=["scale"], pick="argmax", ties=True)
# One site per pass: greedy pick, all-reduce + norm, embedding, LM head, top-k, logprob.
PROGRAM = [G, dict(kind="norm", seed=2, coll="funcol", norm="hand", dtype="f32", tokens=3,
                   hidden=16, residual=True, eps=1e-6, reduce="sum"),
           dict(kind="embed", seed=3, vocab=11, hidden=4, ids=(2, 3), spelling="masked_fill",
                coll="funcol"),
           dict(kind="lm_head", seed=4, vocab=13, hidden=8, rows=2, coll="funcol"),
           dict(G, seed=5, gather="inplace", pick="topk3", ties=False, ops=["div"]),
           dict(G, seed=6, gather="funcol", pick="logprob", ops=["add"])]
REWRITES = {LA: 1, FUSE: 1, REP: 2, TOPK: 1, STATS: 1}  # PROGRAM's rewrites per pass

# Injection rounds: each faults one point in every pass (the passes fail independently).
# (module, attribute, fail on the n-th call; 0: on every call)
ROUNDS = {
    "inside each pass": [("commfold.passes._local_pick", "insert_call", 2),
                         ("commfold.passes.fuse_allreduce_rmsnorm", "insert_call", 2),
                         ("commfold.passes.replicate_vocab_parallel", "insert_call", 1),
                         # after the rewrite's uses are redirected: the graph is half-done
                         ("commfold.passes.local_topk", "erase_if_dead", 1),
                         ("commfold.passes.local_softmax_stats", "erase_if_dead", 1)],
    "recognizers (a)": [("commfold.passes.local_argmax", "match_greedy", 1),
                        ("commfold.passes.fuse_allreduce_rmsnorm", "match_allreduce", 1),
                        ("commfold.passes.replicate_vocab_parallel", "match_embedding", 1),
                        ("commfold.passes.local_topk", "match_topk", 1),
                        ("commfold.passes.local_softmax_stats", "match_row_reads", 1)],
    # the vocab gather's recognizer, as every pick pass (through after_vocab_gather) and
    # the replication pass call it
    "recognizers (b)": [("commfold.patterns.gather", "match_vocab_gather", 0),
                        ("commfold.passes.fuse_allreduce_rmsnorm", "match_rmsnorm", 1),
                        ("commfold.passes.replicate_vocab_parallel", "match_vocab_gather", 1)],
    "recognizers (c)": [("commfold.passes.replicate_vocab_parallel", "match_lm_head", 1)],
    # only one pass faults: the others' rewrites stay
    "local_argmax only": [("commfold.passes._local_pick", "insert_call", 3)],
    "local_topk only": [("commfold.passes.local_topk", "erase_if_dead", 1)],
}
STRICT_ROUNDS = ("inside each pass", "recognizers (b)")  # strict=True must raise
# a round's rewrites that move: an LM head left gathered has its argmax taken locally
MOVED = {"recognizers (c)": {LA: 2}}
# the passes a point faults (local_argmax's rewrite is passes/_local_pick.py's
# rewrite_pick; the pick passes reach the vocab gather's recognizer in patterns/gather.py)
PASS_OF = {"commfold.passes.local_argmax": (LA,), "commfold.passes._local_pick": (LA,),
           "commfold.passes.fuse_allreduce_rmsnorm": (FUSE,),
           "commfold.passes.replicate_vocab_parallel": (REP,),
           "commfold.passes.local_topk": (TOPK,),
           "commfold.passes.local_softmax_stats": (STATS,),
           "commfold.patterns.gather": (STATS, TOPK, LA)}


class Injected(RuntimeError):
    pass


def _inject(points):
    """Patch each point to raise Injected on its n-th call; returns an undo function."""
    import importlib

    saved = []
    for mod_name, attr, nth in points:
        mod = importlib.import_module(mod_name)
        real = getattr(mod, attr)
        calls = [0]

        def faulty(*a, _real=real, _calls=calls, _nth=nth, _where=f"{mod_name}.{attr}", **k):
            _calls[0] += 1
            if _calls[0] == _nth or _nth == 0:
                raise Injected(f"injected fault in {_where}")
            return _real(*a, **k)

        setattr(mod, attr, faulty)
        saved.append((mod, attr, real))

    def undo():
        for mod, attr, real in saved:
            setattr(mod, attr, real)
    return undo


class _GraphSeen:
    """A post-grad pass composed after commfold's: records the graph it receives,
    names left out (they count earlier compiles); unkeyed: every compile runs."""

    def __init__(self):
        self.graphs: list[str] = []

    def __call__(self, graph):
        import torch.fx as fx

        at = {n: i for i, n in enumerate(graph.nodes)}
        self.graphs.append("\n".join(
            f"{n.op} {n.target} "
            f"{fx.map_arg((n.args, n.kwargs), lambda a: f'%{at[a]}')}"
            for n in graph.nodes))


def _diff(a: list[str], b: list[str]) -> str:
    import difflib

    return "\n".join(difflib.unified_diff("\n".join(a).splitlines(),
                                           "\n".join(b).splitlines(), lineterm="", n=1))


def _compiled(fn, backend, args):
    """(outputs, the post-grad graphs commfold handed on) of compiling fn."""
    from torch._inductor import config as inductor_config

    seen = _GraphSeen()
    with inductor_config.patch(post_grad_custom_post_pass=seen):
        got = torch.compile(fn, backend=backend)(*[a.clone() for a in args])
    return got, seen.graphs


def injected_faults(rounds: dict, strict_rounds) -> dict:
    fn = fp.build(PROGRAM)
    args = fp.inputs(PROGRAM)
    torch._dynamo.reset()
    want = torch.compile(fn, backend="inductor")(*[a.clone() for a in args])
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("commfold").addHandler(handler)
    out = {}
    try:
        for name, points in rounds.items():
            for strict in (False, True) if name in strict_rounds else (False,):
                undo = _inject(points)
                records.clear()
                torch._dynamo.reset()
                seen = len(commfold.reports())
                # a fresh config per round and rank: no cached graph skips the passes
                nonce = ("test_nonce", f"{name}-{dist.get_rank()}")
                backend = commfold.backend(strict=strict, extra=(nonce,))
                try:
                    got, graphs = _compiled(fn, backend, args)
                except Exception as e:
                    out[name, strict] = {"raised": "injected fault" in str(e)}
                    continue
                finally:
                    undo()
                reps = commfold.reports()[seen:]
                # the graph commfold hands on is the one it makes without the faulted passes
                healthy = tuple(p for p in commfold.ALL_PASSES
                                if p not in {q for m, _, _ in points for q in PASS_OF[m]})
                torch._dynamo.reset()
                _, healthy_graphs = _compiled(fn, commfold.backend(
                    passes=healthy, extra=(("test_nonce", f"{name}-{dist.get_rank()}-ok"),)),
                    args)
                out[name, strict] = {
                    "raised": False, "mismatches": fp.compare(PROGRAM, got, want),
                    "graph_diff": _diff(graphs, healthy_graphs),
                    "errors": sorted((e.pass_name, e.error) for r in reps for e in r.errors),
                    "counts": {p: sum(r.count(p) for r in reps) for p in REWRITES},
                    "warnings": [r.getMessage() for r in records]}
    finally:
        logging.getLogger("commfold").removeHandler(handler)
    return out


def test_injected_faults(ranks2):
    for res in ranks2.run(injected_faults, ROUNDS, STRICT_ROUNDS):
        for name, points in ROUNDS.items():
            r = res[name, False]
            assert not r["raised"] and r["mismatches"] == [], (name, r)
            assert r["graph_diff"] == "", (name, r["graph_diff"])
            faulted = {p: f"Injected: injected fault in {m}.{a}"
                       for m, a, _ in points for p in PASS_OF[m]}
            # a failing pass is undone entirely; the others keep their rewrites
            want_counts = {p: 0 if p in faulted else n
                           for p, n in dict(REWRITES, **MOVED.get(name, {})).items()}
            assert r["counts"] == want_counts, (name, r)
            assert r["errors"] == sorted(faulted.items()), (name, r)
            for pass_name, error in faulted.items():
                assert any(pass_name in w and error in w for w in r["warnings"]), (name, r)
        for name in STRICT_ROUNDS:
            assert res[name, True] == {"raised": True}, name  # strict raises


# ------------------------------------------------------------------ awkward graphs

@torch.library.custom_op("commfold_test::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, s: float) -> None:
    """An in-place custom op: functionalized into auto_functionalized nodes."""
    x.mul_(s)


@scale_.register_fake
def _(x, s):
    return None


def awkward(logits, x, r, w, ids, table):
    """Greedy pick after an in-place custom op, an in-place all-reduce on a graph
    input (copy_ write-back) feeding a norm, and an embedding."""
    logits = logits * 1
    scale_(logits, 0.5)  # auto_functionalized
    tokens = all_gather_last_dim(logits).argmax(-1)
    dist.all_reduce(x)  # in place on the input: the caller sees the sum
    h = x * 1  # read besides the norm: the fused op's second output serves it
    hf = x.float()
    normed = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    vs, rank = table.shape[0], dist.get_rank()
    outside = (ids < rank * vs) | (ids >= (rank + 1) * vs)
    e = F.embedding((ids - rank * vs).masked_fill(outside, 0), table)
    emb = funcol.all_reduce(e.masked_fill(outside.unsqueeze(-1), 0.0), "sum", dist.group.WORLD)
    return tokens, normed, h, emb


def _awkward_inputs(rows: int, seed: int = 0):
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 4 * world, generator=g)[:, rank * 4:(rank + 1) * 4].contiguous()
    x = torch.randn(world, rows, 16, generator=g)[rank].contiguous()
    r, w = torch.randn(rows, 16, generator=g), torch.randn(16, generator=g)
    ids = torch.randint(0, 10, (rows, 2), generator=g)
    table = torch.randn(5 * world, 8, generator=g)[rank * 5:(rank + 1) * 5].contiguous()
    return [logits, x, r, w, ids, table]


def _check(got, want, inputs_got, inputs_want) -> list[str]:
    bad = []
    modes = ["exact", "f32", "exact", "exact"]
    for i, (a, b, m) in enumerate(zip(got, want, modes)):
        ok, rel = fp._same(a, b, m)
        if not ok:
            bad.append(f"output {i}: {tuple(a.shape)} vs {tuple(b.shape)}, rel {rel:g}")
    if not torch.equal(inputs_got[1], inputs_want[1]):
        bad.append("the in-place all-reduce's write-back to the input differs")
    return bad


# torch 2.11-2.12 fail a 0-row batch of this program in their own trace (plain Inductor
# too): commfold must then raise the same error, and compiles nothing
EMPTY_BATCH_RAISES = torch_version() < (2, 13)


def awkward_graphs() -> dict:
    """Per scenario: mismatches vs plain Inductor, rewrites, errors, graphs compiled."""
    out = {}
    scenarios = {  # name: (torch.compile kwargs, row counts run in turn, mark_dynamic)
        # (1 row: torch 2.13 funcol fails, eager too)
        "dynamic=True": ({"dynamic": True}, [3, 5, 2], False),
        "mark_dynamic": ({}, [4, 2], True),
        "recompile": ({"dynamic": False}, [3, 6], False),
        "empty batch": ({"dynamic": False}, [0], False),
    }
    for name, (kw, rows_list, mark) in scenarios.items():
        torch._dynamo.reset()
        seen = len(commfold.reports())
        backend = commfold.backend(extra=(("test_nonce", f"{name}-{dist.get_rank()}"),))
        ours = torch.compile(awkward, backend=backend, **kw)
        plain = torch.compile(awkward, backend="inductor", **kw)
        res = {"bad": [], "raised": []}
        for rows in rows_list:
            args = _awkward_inputs(rows)
            a1, a2 = [a.clone() for a in args], [a.clone() for a in args]
            if mark:
                for a in a1[:3] + a1[4:5] + a2[:3] + a2[4:5]:
                    torch._dynamo.mark_dynamic(a, 0)
            try:
                want = plain(*a2)
            except Exception as e:  # what plain Inductor does, commfold must do too
                want = e
            try:
                got = ours(*a1)
            except Exception as e:
                got = e
            if isinstance(want, Exception) or isinstance(got, Exception):
                res["raised"].append(f"rows {rows}: {type(got).__name__} / {type(want).__name__}")
                if type(want) is not type(got):
                    res["bad"].append(f"rows {rows}: commfold {got!r} vs inductor {want!r}")
                continue
            res["bad"] += [f"rows {rows}: {m}" for m in _check(got, want, a1, a2)]
        reps = commfold.reports()[seen:]
        res["rewrites"] = sorted(w.pass_name for r in reps for w in r.rewrites)
        res["errors"] = [e.error for r in reps for e in r.errors]
        res["near"] = sorted({f"{m.pass_name}: {m.reason}" for r in reps for m in r.near_misses})
        res["graphs"] = len(reps)
        out[name] = res
    return out


def test_awkward_graphs(ranks2):
    per_rank = ranks2.run(awkward_graphs)
    for res in per_rank:
        for name, r in res.items():
            assert r["bad"] == [] and r["errors"] == [], (name, r)
            if name == "empty batch" and EMPTY_BATCH_RAISES:  # as plain Inductor does
                assert r["raised"] == ["rows 0: TorchRuntimeError / TorchRuntimeError"], r
                continue
            assert r["raised"] == [] and r["graphs"] >= 1, (name, r)
        # each site was rewritten in every compiled graph; with dynamic=True the
        # embedding table's rows are symbolic too, so its shard bounds are run-time
        # values and replication declines (a near-miss says so)
        every = sorted([LA, FUSE, REP])
        for name, per_graph in (("mark_dynamic", every), ("recompile", every),
                                ("dynamic=True", sorted([LA, FUSE]))):
            r = res[name]
            assert r["rewrites"] == sorted(per_graph * r["graphs"]), (name, r)
        assert any(REP in m and "symbol" in m for m in res["dynamic=True"]["near"]), res
        assert res["recompile"]["graphs"] == 2  # new static shapes: compiled again
    assert per_rank[0] == per_rank[1] or all(
        r["rewrites"] == per_rank[0][n]["rewrites"] for n, r in per_rank[1].items())
