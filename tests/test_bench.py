"""The performance suite runs (a smoke test on tiny sizes: not a timed test), and the
compile-time savings (Checkpoint restore, one lint after all passes, cheap fake
values) keep commfold's behaviour.

- `commfold bench --quick` (run from outside the checkout: the CLI finds the suite)
  writes results.json with every figure's rows, results.md with every table, and the
  communication each rewritten form really ran (record_collectives) equals its lower
  bound: one int64 pair per row for local_argmax, the kept all-reduce for the fused
  norm, nothing for replication, their sum for a decode step; the baseline sends more.
- A pass whose rewrite leaves a malformed graph is caught by the final lint, dropped
  (report.errors), the graph restored from the Checkpoint (the full-row gather runs
  again), and the result equals plain Inductor's.
- insert_call's cheap fake values (meta stand-ins, remembered per input metadata)
  equal FakeTensorMode dispatch's for every commfold op.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._inductor import config as inductor_config

import commfold
from commfold import cli
from commfold.distributed.comm_log import record_collectives

from harness.gathers import all_gather_last_dim

ROOT = Path(__file__).resolve().parent.parent
REWRITES = {"local_argmax", "allreduce_rmsnorm", "replicate"}


# The three rewrites' figures; `slow` adds a run with the decode step (their sum) and
# commfold's compile-time share (two compiles with Inductor's caches off). Either run
# starts the suite's ranks.
@pytest.fixture(scope="module", params=[
    pytest.param(REWRITES, id="rewrites", marks=pytest.mark.ranks),
    pytest.param(REWRITES | {"decode", "compile_cost"}, id="full",
                 marks=[pytest.mark.ranks, pytest.mark.slow])])
def figures(request) -> set[str]:
    return request.param


@pytest.fixture(scope="module")
def quick_run(figures, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("bench")
    out = cwd / "results"  # --out relative to the caller's cwd, not the checkout's
    # the rewrites' figures (the sampling figure's passes have tests of their own). The CLI
    # runs in this process (one torch import less); the suite is its subprocess, whose
    # output pytest shows if this fails.
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        code = cli.main(["bench", "--quick", "--out", "results", "--only", *sorted(figures)])
    assert code == 0
    return out, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_quick_suite_writes_every_figure(quick_run, figures):
    out, results, md = quick_run
    assert results["meta"]["quick"] is True
    assert set(results["figures"]) == figures
    for name, fig in results["figures"].items():
        assert fig["errors"] == [], (name, fig["errors"])
        assert fig["rows"] and fig["world_sizes"] == [2], name
        assert f"`{name}`" in md
    keys = {"local_argmax": {"B", "V", "inductor_s", "commfold_s", "same"},
            "allreduce_rmsnorm": {"T", "H", "unfused_s", "fused_s", "max_abs_diff"},
            "replicate": {"layer", "r", "sharded_s", "replicated_s", "build_s"},
            "decode": {"B", "inductor_tok_s", "commfold_tok_s", "same", "rewrites"},
            "compile_cost": {"layers", "nodes", "compile_s", "commfold_s", "commfold_cpu_s",
                             "rewrites"}}
    figs = results["figures"]
    for name in figures:
        for row in figs[name]["rows"]:
            assert keys[name] <= set(row), (name, keys[name] - set(row))
    assert all(r["same"] for r in figs["local_argmax"]["rows"]
               + figs.get("decode", {"rows": []})["rows"])
    assert all(r["max_abs_diff"] < 1e-4 for r in figs["allreduce_rmsnorm"]["rows"])
    for r in figs.get("compile_cost", {"rows": []})["rows"]:
        assert 0 < r["commfold_s"] < r["compile_s"] and 0 < r["commfold_cpu_s"]
        assert r["rewrites"] > 0
    assert {r["layer"] for r in figs["replicate"]["rows"]} == {"embedding", "head"}
    assert "## Communication per call" in md
    assert ("Targets: share" in md) == ("compile_cost" in figures)
    plots = sorted(p.name for p in out.glob("*.png"))
    if importlib.util.find_spec("matplotlib") is not None:
        assert plots == sorted(f"{n}.png" for n in figures)
        assert all(f"]({p})" in md for p in plots)
    else:
        assert plots == [] and "Plots skipped" in md


def test_rewritten_forms_send_their_lower_bound(quick_run, figures):
    _, results, md = quick_run
    seen = set()
    for name, fig in results["figures"].items():
        for r in fig["rows"]:
            if "comm" not in r:
                continue
            seen.add(name)
            c = r["comm"]
            assert c[r["rewritten"]] == c["bound"], (name, r)
            assert c[r["baseline"]]["bytes"] >= c["bound"]["bytes"]
    assert seen == figures - {"compile_cost"}
    argmax = results["figures"]["local_argmax"]["rows"]
    assert all(r["comm"]["bound"] == {"bytes": 16 * r["B"], "calls": 1} for r in argmax)
    assert all(r["comm"]["inductor"]["bytes"] == r["B"] * (r["V"] // 2) * 4 for r in argmax)
    rep = results["figures"]["replicate"]["rows"]
    assert all(r["comm"]["replicated"] == {"bytes": 0, "calls": 0} for r in rep)
    assert "| NO |" not in md


def test_without_matplotlib_json_and_markdown_still_written(quick_run, figures, tmp_path,
                                                             monkeypatch, capsys):
    _, results, _ = quick_run
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    from benchmarks.suite import write_results

    written = write_results(results, tmp_path)
    assert written["plots"] == [] and "pip install" in written["plots_skipped"]
    assert json.loads((tmp_path / "results.json").read_text())["figures"].keys() == figures
    md = (tmp_path / "results.md").read_text()
    assert "Plots skipped: matplotlib is not installed" in md and ".png" not in md
    assert "plots skipped" in capsys.readouterr().out


def test_bench_cli_without_a_checkout(monkeypatch, capsys, tmp_path):
    import commfold.cli as cli

    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "commfold" / "cli.py"))
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs a source checkout" in err and "python -m benchmarks" in err


def test_bench_cli_out_is_relative_to_the_callers_cwd(tmp_path):
    """The suite runs in the checkout (a subprocess, cwd there): --out must still name a
    folder under the caller's cwd (quick_run runs it so, end to end)."""
    import commfold.cli as cli

    assert cli._absolute_out(["--quick", "--out", "r", "--out=s"], tmp_path) == [
        "--quick", "--out", str(tmp_path / "r"), f"--out={tmp_path / 's'}"]


# ---------------------------------------------------------------- lint once

def greedy(x):
    return all_gather_last_dim(x).argmax(-1)


def malformed_rewrite_program() -> dict:
    """local_argmax rewrites, then leaves a node that reads a value defined after it."""
    import commfold.passes as passes

    real = passes.PASSES["local_argmax"]

    def rewrite_then_malform(ctx):
        real(ctx)
        g = ctx.graph
        late = [n for n in g.nodes if n.op == "call_function"][-1]
        with g.inserting_before(next(iter(g.nodes))):
            g.call_function(torch.ops.aten.neg.default, (late,))

    passes.PASSES["local_argmax"] = rewrite_then_malform
    try:
        torch._dynamo.reset()
        x = torch.randn(3, 40) + dist.get_rank()
        fn = torch.compile(greedy, backend=commfold.backend())
        # no FX graph cache: the patched pass is not in its key (a cached graph would
        # skip the pass here, and serve this broken rewrite to other tests' compiles)
        with inductor_config.patch(fx_graph_cache=False):
            got = fn(x)
        report = commfold.last_report()
        with record_collectives() as log:
            fn(x)
        return {"equal": torch.equal(got, greedy(x)), "rewrites": report.count("local_argmax"),
                "errors": [e.pass_name for e in report.errors],
                "gather_elements": log.elements("all_gather")}
    finally:
        passes.PASSES["local_argmax"] = real


def test_final_lint_drops_a_malformed_rewrite(ranks2):
    for res in ranks2.run(malformed_rewrite_program):
        assert res == {"equal": True, "rewrites": 0, "errors": ["local_argmax"],
                       "gather_elements": 3 * 40}  # the full row gather runs again


# ------------------------------------------------- insert_call's fake values

def test_insert_call_fake_values_equal_fake_dispatch(monkeypatch):
    """insert_call computes commfold ops' fake values on meta stand-ins (and remembers
    them per input metadata): the same shapes, strides, dtypes, devices and fake mode
    as FakeTensorMode's dispatch, for every op, transposed inputs and repeat calls."""
    import torch.fx as fx
    from torch._higher_order_ops.auto_functionalize import auto_functionalized
    from torch._subclasses.fake_tensor import FakeTensorMode

    import commfold.fx.fake_values as fv
    from commfold.fx.edit import insert_call
    importlib.import_module("commfold.ops")  # registers the ops
    from commfold.ops.allreduce_rmsnorm import pack_flags

    mode = FakeTensorMode()
    ops = torch.ops.commfold

    def values():
        g = fx.Graph()
        g._commfold_fake_mode = mode

        def ph(shape, dtype=torch.float32, transpose=False):
            p = g.placeholder(f"p{len(g.nodes)}")
            with mode:
                v = torch.empty(shape, dtype=dtype)
            p.meta["val"] = v.t() if transpose else v
            return p

        bf = torch.bfloat16
        x, r, w = ph((5, 8), bf), ph((5, 8), bf), ph((8,), bf)
        s, st = ph((3, 7)), ph((7, 3), transpose=True)
        ids, shard, h = ph((4,), torch.int64), ph((6, 8)), ph((2, 8))
        flags = pack_flags(round_sum=True, out_f32=True)
        calls = [(ops.allreduce_rmsnorm.default, (x, r, w, 1e-6, 0.0, flags, "c10d:0")),
                 (ops.allreduce_rmsnorm.default, (x, None, None, 1e-6, 1.0, 0, "c10d:0")),
                 (ops.local_argmax.default, (s, 10, "c10d:0", True)),
                 (ops.local_argmax.default, (st, None, "c10d:0")),
                 (ops.replicated_embedding.default, (ids, shard, [0, 6, 0], 2, "c10d:0")),
                 (ops.replicated_lm_head.default, (h, shard, 11, 2, "c10d:0")),
                 (auto_functionalized, (ops.allreduce_rmsnorm.default,),
                  dict(x=st, residual=None, weight=None, eps=1e-6, weight_offset=0.0,
                       flags=0, comm="c10d:0"))]
        out = []
        for target, args, *kwargs in calls * 2:  # the second round hits the remembered metadata
            v = insert_call(g, target, args, *kwargs).meta["val"]
            out.append([(type(t).__name__, tuple(t.shape), t.stride(), t.dtype, t.device,
                         t.fake_mode is mode) for t in (v if isinstance(v, tuple) else (v,))])
        return out

    fast = values()
    monkeypatch.setattr(fv, "_fake_kernel", lambda target, args=(): None)  # plain fake dispatch
    assert fast == values()
    assert fast[0][0][3] == torch.float32 and fast[1][0][3] == torch.bfloat16  # the flags
    assert fast[2][0][1] == (3, 1)
    cpu = torch.device("cpu")  # auto_functionalized: (normed, the written x with its strides)
    assert fast[6] == [("FakeTensor", (3, 7), (7, 1), torch.float32, cpu, True),
                       ("FakeTensor", (3, 7), (1, 3), torch.float32, cpu, True)]


def test_only_keeps_the_other_figures(tmp_path):
    """`--only` reruns some figures: the others of the run already in the output
    directory stay (with their own date), in the suite's order; a --quick run never
    mixes with a full one."""
    from benchmarks.suite import FIGURES, keep_previous

    def run(date, quick, names):
        return {"meta": {"date": date, "quick": quick},
                "figures": {n: {"title": n, "rows": [date]} for n in names}}

    (tmp_path / "results.json").write_text(json.dumps(run("old", False, list(FIGURES))))
    new = keep_previous(run("new", False, ["decode"]), tmp_path)
    assert list(new["figures"]) == list(FIGURES)
    assert new["figures"]["decode"]["rows"] == ["new"] and "date" not in new["figures"]["decode"]
    assert all(f["rows"] == ["old"] and f["date"] == "old"
               for n, f in new["figures"].items() if n != "decode")
    quick = keep_previous(run("new", True, ["decode"]), tmp_path)
    assert list(quick["figures"]) == ["decode"]
    kept = keep_previous(run("new", False, ["decode"]), tmp_path / "none")
    assert kept["figures"].keys() == {"decode"}


@pytest.mark.parametrize("failing", [False, True])
def test_engine_flag_reruns_the_engine_figures_into_out(tmp_path, monkeypatch, failing):
    """`python -m benchmarks --engine` is the one command for every results file: the
    engine figures with the README's settings, into the same --out; their failure
    fails the command."""
    from benchmarks import bench_vllm_engine, suite

    calls = []
    monkeypatch.setattr(suite, "run_suite", lambda names, quick, timeout: {
        "meta": {"seconds": 0.0, "quick": quick}, "figures": {}})
    monkeypatch.setattr(suite, "write_results", lambda results, out: {
        "json": out / "results.json", "markdown": out / "results.md", "plots": []})
    monkeypatch.setattr(bench_vllm_engine, "main",
                        lambda argv: calls.append(argv) or int(failing))
    assert suite.main(["--only", "scan", "--out", str(tmp_path)]) == 0 and calls == []
    assert suite.main(["--only", "scan", "--engine", "--out", str(tmp_path)]) == int(failing)
    assert calls == [[*suite.ENGINE_ARGS, "--out", str(tmp_path)]]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_paired_rounds_put_every_variant_in_every_position(n):
    """Over 2n rounds each variant runs first, last and in between equally often."""
    from harness.bench import paired_rounds

    calls = []
    variants = {k: (lambda k=k: calls.append(k)) for k in "abcd"[:n]}
    paired_rounds(variants, (), rounds=2 * n, block_s=0.0, warmup=0)
    seq = calls[1:]  # the first call sizes the block (one call per block here)
    rounds = [seq[i:i + n] for i in range(0, len(seq), n)]
    assert len(rounds) == max(2 * n, 5) and all(sorted(r) == sorted(variants) for r in rounds)
    first = rounds[:2 * n]
    for pos in range(n):
        counts = {k: sum(r[pos] == k for r in first) for k in variants}
        assert set(counts.values()) == {2}, (pos, counts)

