"""The `commfold` command: `commfold diff` on the funcol example at 2 ranks (files,
table, exit code), its bad-input paths (missing script or module, nothing compiled,
a crashing rank with dumps kept, a hung rank), --help, and `commfold demo`."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import commfold
from commfold import cli
from commfold.report import format_bytes
from commfold.torch_compat import torch_version

ROOT = Path(__file__).resolve().parents[1]
FUNCOL = ROOT / "examples" / "tp_decoder_funcol.py"


def commfold_cli(*args, timeout=600, cwd=None):
    """The real command, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "commfold.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT)


def main_in_process(capsys, *args) -> tuple[int, str]:
    """cli.main in this process (saves a torch import per call); (exit code, stdout)."""
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:  # argparse: --help, usage errors
        code = e.code
    return code, capsys.readouterr().out


def error_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("commfold diff: error:")]


@pytest.mark.ranks
def test_diff_funcol_example_two_ranks(tmp_path):
    sys.path.insert(0, str(FUNCOL.parent))
    try:
        import tp_decoder_funcol as ex
    finally:
        sys.path.pop(0)
    # local_argmax first, so it (not replication) takes the LM head's gather.
    passes = ["local_argmax"] + [p for p in commfold.ALL_PASSES if p != "local_argmax"]
    out = tmp_path / "dump"
    done = commfold_cli("diff", FUNCOL, "--world-size", 2, "--out", out,
                        "--passes", ",".join(passes))
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout

    # progress: every rank's stages, in order
    for r in (0, 1):
        stages = re.findall(rf"\] rank {r}: (.*)", text)
        assert stages[0] == "importing torch and commfold" and stages[-1] == "done", stages
        assert any(s.startswith("compiling (dynamo frame") for s in stages)
        assert any(s.startswith("compiling graph 0: pass local_argmax done (1 rewrite")
                   for s in stages)

    # the table: the example compiles twice (stock inductor and backend="commfold"),
    # and under `commfold diff` both run the chosen passes.
    rows = [ln for ln in text.splitlines() if "| local_argmax " in ln]
    assert len(rows) == 2, text
    cfg = ex.CONFIG
    padded_vocab = -(-cfg.vocab // 2) * 2
    before = f"{format_bytes(ex.BATCH * padded_vocab * 4)} in 1 call"
    # (value, index) int64 pair per row per rank
    after = f"{format_bytes(ex.BATCH * 16 * 2)} in 1 call"
    for graph, row in enumerate(rows):
        cells = [c.strip() for c in row.split("|")]
        assert cells[:3] == [str(graph), "local_argmax", "all_gather->argmax"], row
        assert re.fullmatch(r"cli/demo_model\.py:\d+ \(forward\)", cells[3]), row
        assert cells[4] == f"{before} -> {after}", row
        assert cells[5] == "0 B"
    if "fuse_allreduce_rmsnorm" in commfold.ALL_PASSES:
        assert "| fuse_allreduce_rmsnorm " in text
    assert "ranks: all 2 decided the same on every graph" in text
    assert (out / "summary.txt").read_text().strip() in text

    # the files, per rank and per pass
    tokens = []
    for r in (0, 1):
        rank = out / f"rank{r}"
        graphs = json.loads((rank / "report.json").read_text())
        assert [g["graph"] for g in graphs] == [0, 1]
        assert [p["pass"] for p in graphs[0]["passes"]] == passes
        i = passes.index("local_argmax")
        stem = rank / "graph0" / f"{i:02d}_local_argmax"
        before_py = Path(f"{stem}.before.py").read_text()
        after_py = Path(f"{stem}.after.py").read_text()
        diff = Path(f"{stem}.diff").read_text()
        compile(before_py, "before", "exec")  # readable Python, really
        compile(after_py, "after", "exec")
        assert "_c10d_functional.all_gather_into_tensor" in before_py
        assert "# File: " in before_py and "demo_model.py" in before_py
        assert "commfold.local_argmax" in after_py
        assert "_c10d_functional.all_gather_into_tensor" not in after_py
        assert re.search(r"^-.*all_gather_into_tensor", diff, re.M)
        assert re.search(r"^\+.*commfold\.local_argmax", diff, re.M)
        depyf_files = [f.name for f in (rank / "depyf").iterdir()]
        if torch_version() < (2, 13) and "NOT_WRITTEN.txt" in depyf_files:
            # depyf cannot read torch 2.11's bytecode: the diff says so, and is complete
            why = (rank / "depyf" / "NOT_WRITTEN.txt").read_text()
            assert why.startswith("depyf ") and "could not write its dumps on torch" in why
            assert re.search(rf"\] rank {r}: depyf .* could not write its dumps", text), text
        else:
            assert any(f.startswith("full_code_for_forward") for f in depyf_files), depyf_files
        assert any(f.startswith("__transformed_code_") for f in depyf_files), depyf_files
        log = (rank / "log.txt").read_text()
        # the example's own check (run whole here; test_examples.py does not run it again)
        assert "commfold report, graph 0:" in log
        tokens.append(re.search(r"^greedy tokens identical to stock Inductor on 1 rank\(s\), "
                                r"and across ranks: (\[.*\])$", log, re.M).group(1))
    assert tokens[0] == tokens[1]  # and the same on both ranks
    assert (json.loads((out / "rank0" / "report.json").read_text())[0]["fingerprint"]
            == json.loads((out / "rank1" / "report.json").read_text())[0]["fingerprint"])


CRASH_AFTER_COMPILE = """
import torch, torch.distributed as dist

def run():  # called on every rank, process group already initialized
    torch.compile(lambda x: x * 2 + 1)(torch.randn(8))
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()
"""

HANG = """
import time, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(3600)
dist.barrier()
"""


@pytest.mark.ranks
def test_diff_bad_inputs(tmp_path, capsys, monkeypatch):
    # a missing script, a missing module, an unknown pass: exit 2, one line, no ranks
    for args, why in [(["no_such_script.py"], "no such script: no_such_script.py"),
                      (["no_such_module_xyz:main"], "no module named 'no_such_module_xyz'"),
                      ([FUNCOL, "--passes", "bogus"], "unknown pass(es) ['bogus']")]:
        code, out = main_in_process(capsys, "diff", *args, "--out", tmp_path / "bad")
        assert code == 2, out
        assert error_lines(out) == [out.strip()] and why in out, out

    # a target that compiles nothing: exit 2 (one rank: the check is per rank)
    code, out = main_in_process(capsys, "diff", "os:getcwd", "--out", tmp_path / "nothing",
                                "--world-size", 1)
    assert code == 2, out
    [line] = error_lines(out)
    assert "compiled nothing with Inductor" in line

    # a module:function whose rank 1 crashes after a compile: exit 1, the cause, the
    # dumps kept (the module sits in the working directory, as for `python -m`)
    (tmp_path / "crashing_target.py").write_text(CRASH_AFTER_COMPILE)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "crash"
    code, text = main_in_process(capsys, "diff", "crashing_target:run", "--out", out,
                                 "--passes", "local_argmax")
    assert code == 1, text
    [line] = error_lines(text)
    assert "rank 1 failed:" in line and "ValueError: boom on rank 1" in line, line
    assert "boom on rank 1" in (out / "rank1" / "log.txt").read_text()
    for r in (0, 1):
        assert (out / f"rank{r}" / "graph0" / "00_local_argmax.before.py").is_file()
        assert (out / f"rank{r}" / "graph0" / "00_local_argmax.diff").read_text() \
            == "# local_argmax: no change\n"

    # a rank that hangs: killed at --timeout, exit 1, where each rank was
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    # (30 s: the ranks import torch first, which takes > 10 s on a loaded 2-core machine)
    code, text = main_in_process(capsys, "diff", script, "--out", tmp_path / "hang",
                                 "--timeout", 30)
    assert code == 1, text
    [line] = error_lines(text)
    assert "still running after 30s" in line and "rank 1 in 'running target'" in line, line


def _failing_rank(out_dir, r, after_s, cause):
    """A stand-in rank process: writes a traceback ending in `cause` to its log after
    `after_s` seconds and exits 1."""
    (out_dir / f"rank{r}").mkdir()
    log = open(out_dir / f"rank{r}" / "log.txt", "w")
    code = (f"import sys, time; time.sleep({after_s}); "
            f"print('Traceback (most recent call last):'); print({cause!r}); sys.exit(1)")
    return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)


def test_diff_names_the_failing_rank_not_the_peer_that_lost_it(tmp_path):
    """When rank 0's collective fails only because rank 1 left it (gloo: "Connection
    closed by peer"), and rank 0 is seen first, the cause named is rank 1's."""
    from commfold.cli.diff.watch import watch

    procs = [_failing_rank(tmp_path, 0, 0, "RuntimeError: [pair.cc:553] Connection closed "
                                         "by peer [127.0.0.1]:7074"),
             _failing_rank(tmp_path, 1, 1.5, "ValueError: boom on rank 1")]
    try:
        line = watch(procs, tmp_path, timeout=60, echo=lambda _: None)
    finally:
        for p in procs:
            p.wait(timeout=10)
    assert line.startswith("rank 1 failed: ValueError: boom on rank 1"), line
    # a peer's loss alone (no other rank failed) is still named
    procs = [_failing_rank(tmp_path / "alone", 0, 0, "RuntimeError: Connection reset by peer")
             for _ in [(tmp_path / "alone").mkdir()]]
    assert watch(procs, tmp_path / "alone", 60, lambda _: None).startswith(
        "rank 0 failed: RuntimeError: Connection reset by peer")


def test_help_documents_every_flag(capsys):
    code, out = main_in_process(capsys, "diff", "--help")
    assert code == 0
    for flag in ("TARGET", "--world-size", "--out", "--passes", "--timeout",
                 "module:function", "Exit status"):
        assert flag in out, flag
    code, out = main_in_process(capsys, "demo", "--help")
    assert code == 0
    for flag in ("--world-size", "--layers", "--hidden", "--vocab", "--dtype", "--batch",
                 "--steps", "--repeats", "--passes", "--timeout"):
        assert flag in out, flag
    code, out = main_in_process(capsys)
    assert code == 2 and "diff" in out and "demo" in out  # no command: usage, failure


@pytest.mark.ranks
def test_demo_small(capsys, tmp_path, monkeypatch):
    # in this process (its ranks fork from the preloaded server): saves two torch imports
    monkeypatch.chdir(tmp_path)
    code, out = main_in_process(capsys, "demo", "--vocab", 1001, "--hidden", 64, "--ffn", 128,
                                "--layers", 1, "--batch", 4, "--seq", 8, "--steps", 2,
                                "--repeats", 2)
    assert code == 0, out
    assert "tokens: identical - 8 greedy tokens (4 sequences x 2 steps), on all 2 ranks" in out
    assert re.search(r"decode step \(median of 2, rank 0\): inductor [\d.]+ ms, commfold [\d.]+ ms "
                     r"-> [\d.]+x", out), out
    inductor = re.search(r"^  inductor  (.*)$", out, re.M).group(1)
    ours = re.search(r"^  commfold  (.*)$", out, re.M).group(1)
    # the vocab-sharded head's logits all_gather (8.0 KiB = 4 rows x 501 f32 per rank) is
    # gone or shrunk in whatever commfold wrote instead
    assert "all_gather x1 (7.8 KiB)" in inductor, inductor
    assert "7.8 KiB" not in ours.split("all_reduce")[0], ours
    assert re.search(r"^\s+(local_argmax|replicate_vocab_parallel)\s+\| ", out, re.M), out


def test_observing_hook_sees_every_pass_and_forces_the_pass_list():
    import torch
    import torch.fx as fx
    from torch.fx.experimental.proxy_tensor import make_fx

    from commfold.cli.diff.render import render
    from commfold.manager import CommfoldPass, observing

    gm = make_fx(lambda x: torch.relu(x * 2).sum(-1))(torch.randn(2, 3))
    pass_ = CommfoldPass(commfold.Config(passes=("local_argmax",)))
    assert pass_.uuid() is not None
    seen = []
    with observing(lambda *a: seen.append(a), passes=commfold.ALL_PASSES):
        assert pass_.uuid() is None  # observed passes must run: no cache key
        pass_(gm.graph)
    assert pass_.uuid() is not None
    assert [name for name, *_ in seen] == list(commfold.ALL_PASSES)
    for _name, before, after, report in seen:
        assert isinstance(before, fx.Graph) and isinstance(after, fx.Graph)
        assert before is not gm.graph and after is not gm.graph  # copies
        assert report.passes == commfold.ALL_PASSES and not report.errors
        text = render(before)
        compile(text, "graph", "exec")
        assert "torch.ops.aten.relu.default" in text and text == render(after)  # nothing to rewrite
    assert commfold.last_report() is seen[-1][3]


def test_console_script_entry_point():
    from importlib.metadata import entry_points

    [ep] = [e for e in entry_points(group="console_scripts") if e.name == "commfold"]
    assert ep.value == "commfold.cli:main" and ep.load() is cli.main


def test_diff_summary_prints_each_near_miss_with_its_source_line(tmp_path):
    """A near-miss's line of user code (from its node's stack trace, torch's own frames
    skipped) is printed under it; a report written before the field existed prints
    the reason alone."""
    import os

    import torch
    import torch.fx as fx

    from commfold.cli.diff.summary import summary
    from commfold.report import NearMiss, source_code, source_location

    g = fx.Graph()
    n = g.placeholder("x")
    n.meta["stack_trace"] = (
        '  File "/work/model.py", line 40, in forward\n    out = self.attn(x)\n'
        '  File "/work/tp.py", line 12, in <lambda>\n'
        '    h = residual + funcol.all_reduce(out[0], "sum", ranks)\n'
        f'  File "{os.path.dirname(torch.__file__)}/distributed/_functional_collectives.py", '
        'line 179, in all_reduce\n    tensor = torch.ops._c10d_functional.all_reduce(\n')
    assert source_location(n) == "work/tp.py:12 (<lambda>)"
    assert source_code(n) == 'h = residual + funcol.all_reduce(out[0], "sum", ranks)'
    assert source_code(g.placeholder("y")) == ""
    miss = NearMiss("fuse_allreduce_rmsnorm", "all_reduce->rmsnorm", source_location(n),
                    "aten.add.Tensor broadcasts ...", source_code(n))
    old = {k: v for k, v in vars(miss).items() if k != "code"}
    graphs = [{"graph": 0, "rewrites": [], "errors": [], "fingerprint": "f",
               "near_misses": [vars(miss), old]}]
    lines = summary([graphs], tmp_path).splitlines()
    at = [i for i, ln in enumerate(lines) if "at work/tp.py:12 (<lambda>): aten.add" in ln]
    assert len(at) == 2, lines
    assert lines[at[0] + 1] == '      | h = residual + funcol.all_reduce(out[0], "sum", ranks)'
    assert lines[at[1] + 1] == "ranks: all 1 decided the same on every graph", lines
