"""The `commfold` command: `commfold diff` (what each pass rewrote, dumped),
`commfold demo` (the 2-rank before/after demo), `commfold bench` (the performance
suite of a source checkout) and `commfold doctor` (what commfold would do inside the
installed vLLM)."""
from __future__ import annotations

import argparse
import sys

_DIFF_EPILOG = """\
TARGET is either
  a script path      run as __main__ on every rank with torchrun's environment
                     (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
                     MASTER_PORT); it initializes its own process group, e.g.
                     dist.init_process_group("gloo"), as under torchrun;
  module:function    imported on every rank and called with no arguments once the
                     rank has initialized the default gloo process group.

Every torch.compile in the target runs commfold with the chosen passes: plain
torch.compile(model) (Inductor's post_grad_custom_post_pass is set to commfold)
as well as backend="commfold" (the chosen passes replace the target's own;
its other options are kept).
Inductor's caches are off in the ranks so every pass really runs.

Written to --out, per rank r and compiled graph g:
  rank<r>/graph<g>/NN_<pass>.before.py  post-grad graph before the pass, as Python
                                        with the user source line of each op
  rank<r>/graph<g>/NN_<pass>.after.py   the same after the pass
  rank<r>/graph<g>/NN_<pass>.diff       unified diff of the two
  rank<r>/graph<g>/report.txt           the graph's commfold report
  rank<r>/depyf/                        depyf's decompiled dynamo code and graphs
  rank<r>/log.txt, progress.log         the rank's output and its stages
  rank<r>/report.json, summary.txt      machine- and human-readable results
Dumps are written as they happen and kept when a rank fails.

Exit status: 0 success; 1 a rank failed or hung (one-line cause printed);
2 bad input (missing script or module, unknown pass, nothing compiled)."""


def _diff_parser(sub) -> None:
    p = sub.add_parser(
        "diff", help="run a program on N CPU ranks under commfold and dump each pass's rewrite",
        description="Run TARGET on N CPU ranks (gloo, 127.0.0.1) under commfold, dump every\n"
                    "pass's post-grad graph before and after, and print a summary table:\n"
                    "pass, pattern, source location, communication per call before -> after\n"
                    "(bytes and calls), extra memory; then near-misses with their reasons.\n"
                    "While it runs it prints the stage each rank is in.",
        epilog=_DIFF_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", help="a script path or module:function (see below)")
    p.add_argument("--world-size", "-n", type=int, default=2, metavar="N",
                   help="number of CPU ranks to run (default: 2)")
    p.add_argument("--out", "-o", default="commfold-diff", metavar="DIR",
                   help="directory for the dumps; its rank<r>/ folders are replaced "
                        "(default: ./commfold-diff)")
    p.add_argument("--passes", default=None, metavar="P1,P2",
                   help="comma-separated commfold passes to run, in order "
                        "(default: every registered pass)")
    p.add_argument("--timeout", type=float, default=600, metavar="SECONDS",
                   help="give up (kill every rank, exit 1) when the run takes longer: "
                        "a rank hung in a collective (default: 600)")


def _bench(argv) -> int:
    """Run the benchmark suite of the source checkout this commfold is installed from
    (an editable install): `python -m benchmarks` in that checkout, as a subprocess.
    The suite is not part of the installed package."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # commfold/cli/__init__.py -> the checkout
    if not (root / "benchmarks" / "suite.py").is_file():
        print(f"commfold bench: needs a source checkout; this commfold is installed without "
              f"one ({root}). Clone the repository and run `python -m benchmarks` in it, or "
              "install commfold from it with `pip install -e .` so that `commfold bench` "
              "finds it.", file=sys.stderr)
        return 2
    argv = _absolute_out(argv, Path.cwd())  # the suite runs in the checkout
    return subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=root).returncode


def _absolute_out(argv: list[str], cwd) -> list[str]:
    """argv with --out DIR / --out=DIR taken relative to the caller's cwd."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--out" and i + 1 < len(out):
            out[i + 1] = str(cwd / out[i + 1])
        elif a.startswith("--out="):
            out[i] = "--out=" + str(cwd / a[len("--out="):])
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="commfold", description="commfold: take tensor-parallel communication out of "
                                     "torch.compile'd LLM inference graphs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _diff_parser(sub)
    sub.add_parser("demo", add_help=False,
                   help="2-rank CPU demo: a TP decoder with and without commfold "
                        "(`commfold demo --help` for its options)")
    sub.add_parser("bench", add_help=False,
                   help="performance suite: commfold vs plain Inductor side by side, JSON + "
                        "markdown + plots (needs a source checkout; `commfold bench --help`)")
    sub.add_parser("doctor", add_help=False,
                   help="which of commfold's vLLM hooks would act here, and why not (no "
                        "engine started; exit 0); vLLM's engine flags after it, e.g. "
                        "--model M --enable-lora: that engine's compilation config")
    if argv[:1] == ["demo"]:  # the demo owns its options
        from commfold.cli.demo import main as demo_main

        return demo_main(argv[1:])
    if argv[:1] == ["doctor"]:  # vLLM's engine arguments follow it
        from commfold.vllm.observe.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv[:1] == ["bench"]:  # so does the suite
        return _bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "diff":
        from commfold.cli.diff import run_diff

        passes = [p for p in (args.passes or "").split(",") if p] or None
        return run_diff(args.target, world_size=args.world_size, out=args.out,
                        passes=passes, timeout=args.timeout)
    parser.print_help()
    return 2

