"""`commfold demo` / `python -m commfold.cli.demo`: the whole story on 2 CPU ranks.

A small tensor-parallel decoder (commfold.cli.demo_model.TPDecoder: functional collectives,
vocab-parallel embedding, all_reduce + residual + RMSNorm per block, vocab-sharded LM
head with all_gather + argmax) is compiled twice on every rank, with stock Inductor
and with commfold. The demo lists commfold's rewrites, counts the collectives that
really run per decode step, checks that the greedy tokens are identical (on every
rank, both programs), and times decode steps of both, interleaved (median of
repeats). Exit status 1 if any token differs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager


def _parser(prog: str = "commfold demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="number of CPU ranks (gloo)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads (divisible by world size)")
    p.add_argument("--ffn", type=int, default=512, help="MLP width (divisible by world size)")
    p.add_argument("--vocab", type=int, default=32000,
                   help="vocabulary size (padded to a multiple of the world size)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--seq", type=int, default=16, help="context window length (tokens)")
    p.add_argument("--steps", type=int, default=8, help="greedy steps per timed run")
    p.add_argument("--repeats", type=int, default=15, help="timed runs per program (median)")
    p.add_argument("--passes", default=None,
                   help="comma-separated commfold passes (default: all registered)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before giving up")
    return p


def _rank(opts: dict) -> dict:
    """Runs on every rank (process group already initialized)."""
    import torch
    import torch.distributed as dist

    import commfold
    from commfold.cli.demo_model import DecoderConfig, TPDecoder, greedy_decode, sample_ids
    from commfold.distributed.comm_log import record_collectives

    cfg = DecoderConfig(vocab=opts["vocab"], hidden=opts["hidden"], layers=opts["layers"],
                        heads=opts["heads"], ffn=opts["ffn"], dtype=getattr(torch, opts["dtype"]))
    model = TPDecoder(cfg)
    ids = sample_ids(cfg, opts["batch"], opts["seq"])
    commfold.clear_reports()
    programs = {
        "inductor": torch.compile(model, backend="inductor"),
        "commfold": torch.compile(model, backend=commfold.backend(passes=opts["passes"])),
    }
    out = {"compile_s": {}, "tokens": {}, "comm": {}, "step_ms": {k: [] for k in programs}}
    with torch.no_grad():
        for name, prog in programs.items():
            t = time.perf_counter()
            prog(ids)
            out["compile_s"][name] = time.perf_counter() - t
            out["tokens"][name] = greedy_decode(prog, ids, opts["steps"]).tolist()
            with _quiet_stderr(), record_collectives() as log:  # kineto prints to fd 2
                prog(ids)
            out["comm"][name] = {k: (log.calls(k), log.bytes(k))
                                 for k in sorted({e.name for e in log.events})}
        for i in range(opts["repeats"]):
            order = list(programs) if i % 2 == 0 else list(programs)[::-1]
            for name in order:
                dist.barrier()
                t = time.perf_counter()
                greedy_decode(programs[name], ids, opts["steps"])
                out["step_ms"][name].append((time.perf_counter() - t) * 1e3 / opts["steps"])
    out["reports"] = [r.summary() for r in commfold.reports()]
    out["rewrites"] = [(w.pass_name, w.pattern) for r in commfold.reports() for w in r.rewrites]
    return out


@contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ libraries' chatter) for a short block."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _fmt_comm(comm: dict) -> str:
    from commfold.report import format_bytes

    if not comm:
        return "none"
    return ", ".join(f"{name} x{calls} ({format_bytes(nbytes)})"
                     for name, (calls, nbytes) in comm.items())


def run(opts: dict, echo=print) -> int:
    import commfold
    from commfold.cli.demo import _rank  # by module name, also when run as __main__
    from commfold.distributed.ranks import RankError, run_on_ranks

    w = opts["world_size"]
    echo(f"commfold demo: {w}-rank tensor-parallel decoder on CPU (gloo): vocab "
         f"{opts['vocab']}, hidden {opts['hidden']}, {opts['layers']} layers, {opts['dtype']}, "
         f"batch {opts['batch']} x {opts['seq']} tokens; passes: {', '.join(opts['passes'])}")
    echo("compiling with stock Inductor and with commfold on every rank (tens of seconds)...")
    try:
        res = run_on_ranks(_rank, w, opts, timeout=opts["timeout"])
    except RankError as e:
        echo(f"commfold demo: failed: {str(e).strip().splitlines()[-1]}")
        return 1
    r0 = res[0]
    echo(f"compile: inductor {r0['compile_s']['inductor']:.1f} s, "
         f"commfold {r0['compile_s']['commfold']:.1f} s (rank 0)")
    echo("commfold rewrites (rank 0):")
    for text in r0["reports"]:
        echo("\n".join("  " + line for line in text.splitlines()))
    echo("collectives per decode step, measured at run time (rank 0):")
    for name in ("inductor", "commfold"):
        echo(f"  {name:9s} {_fmt_comm(r0['comm'][name])}")
    base = [r["tokens"]["inductor"] for r in res]
    same = all(r["tokens"]["commfold"] == b == base[0] for r, b in zip(res, base))
    n_tok = opts["batch"] * opts["steps"]
    if not same:
        echo(f"tokens: MISMATCH between commfold and stock Inductor "
             f"({n_tok} greedy tokens per rank)")
        return 1
    echo(f"tokens: identical - {n_tok} greedy tokens ({opts['batch']} sequences x {opts['steps']} "
         f"steps), on all {w} ranks, with and without commfold")
    base_ms = statistics.median(r0["step_ms"]["inductor"])
    cf_ms = statistics.median(r0["step_ms"]["commfold"])
    echo(f"decode step (median of {opts['repeats']}, rank 0): inductor {base_ms:.2f} ms, "
         f"commfold {cf_ms:.2f} ms -> {base_ms / cf_ms:.2f}x")
    if not r0["rewrites"]:
        echo("note: commfold rewrote nothing here (passes: " + ", ".join(commfold.ALL_PASSES) + ")")
    return 0


def main(argv=None, prog: str = "commfold demo") -> int:
    import commfold
    from commfold.config import unknown_passes

    args = _parser(prog).parse_args(argv)
    passes = [p for p in (args.passes or "").split(",") if p] or list(commfold.ALL_PASSES)
    unknown = unknown_passes(passes)
    if unknown:
        print(f"commfold demo: error: unknown pass(es) {unknown}; registered: "
              f"{list(commfold.ALL_PASSES)}", file=sys.stderr)
        return 2
    opts = {k: v for k, v in vars(args).items()}
    opts["passes"] = passes
    return run(opts)


if __name__ == "__main__":
    sys.exit(main(prog="python -m commfold.cli.demo"))
