"""Engine throughput: vLLM's offline ``LLM.generate`` at TP=2 on this CPU, without
speculative decoding, with ``draft_model`` and with ``eagle3``, each as vLLM ships it
("vllm"), with vLLM's hand-written local argmax for the draft pick
("vllm-local-argmax", ``use_local_argmax_reduction``) and with commfold
(COMMFOLD_VLLM=1, the target's pick included) and with that pick off
("commfold-no-target-pick", COMMFOLD_TARGET_PICK=0).

    python -m benchmarks.bench_vllm_engine                  # the table (~35 min)
    python -m benchmarks.bench_vllm_engine --methods none --variants vllm commfold \
        commfold-no-target-pick                             # the target pick's judge
    python -m benchmarks.bench_vllm_engine --methods eagle3 --variants vllm commfold
    python -m benchmarks.bench_vllm_engine --report        # table + plot from the JSON
    python -m benchmarks.bench_vllm_engine --shape llama-3.2-1b --layers 4  # real shapes

``--shape`` other than ``toy`` (the model below) runs a real model's shape instead,
greedy and logprobs=5 traffic, the variants interleaved round by round
(benchmarks/engine_shapes.py; results in vllm_shapes.json / .md).

Models (harness.spec_models, real seeded weights, written once under
--models): a 4-layer Llama target, hidden 1024, 16 heads (8 KV), V=151936, bf16, whose
next token mostly follows a fixed permutation; a ``draft_model`` drafter of the
DSpark change's Markov-head shape (1 layer, hidden 128, the same V: a 37 MiB
embedding, under commfold's replication rule); an EAGLE-3 head (1 layer, hidden
1024, a 32000-token draft vocab with a d2t remap). Drafts are accepted often and
rejected sometimes, so the verify path does both.

Each (method, variant) is one engine started in this process. Per concurrency C
(1, 8, 64): C prompts of 16 tokens, ``--tokens`` new tokens each (ignore_eos,
greedy), max_num_seqs = C; one warm-up run, then ``--repeats`` timed runs: output
tokens/s is C x tokens / the median wall time. Generated tokens must equal the
"vllm" variant's (bit-exact rewrites). Acceptance is vLLM's counters over the timed
runs. Collective bytes per engine step come from the step log
(COMMFOLD_COMM_LOG_DIR), paused while timing (a profiler around each step perturbs
it) and on for one last run at C=8: per phase (forward, target logits, sampling,
drafting), averaged over the steps that drafted (all decode steps without spec
decoding).

Results merge into --out/vllm_engine.json (pieces can run separately);
vllm_engine.md and vllm_engine.png are rewritten from it.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import engine_shapes  # noqa: E402
from benchmarks.engine_shapes import SHAPES  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
METHODS = ("none", "draft_model", "eagle3")
TARGET = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
              num_attention_heads=16, num_key_value_heads=8, head_dim=64)
DRAFT = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)  # the draft_model drafter
K = 3  # draft tokens per step
PROMPT_LEN = 16


DEFAULT_VARIANTS = ("vllm", "vllm-local-argmax", "commfold", "commfold-no-target-pick")


def variants() -> dict[str, dict]:
    """variant -> (environment, use_local_argmax_reduction)."""
    out = {"vllm": ({"COMMFOLD_VLLM": ""}, False),
           "vllm-local-argmax": ({"COMMFOLD_VLLM": ""}, True),
           "commfold": ({"COMMFOLD_VLLM": "1"}, False)}
    if importlib.util.find_spec("commfold.vllm.target.target_pick") is not None:
        out["commfold-no-target-pick"] = ({"COMMFOLD_VLLM": "1", "COMMFOLD_TARGET_PICK": "0"},
                                          False)
    return out


def write_models(root: Path) -> dict:
    """The model set under root/<config hash> (written once)."""
    from harness.spec_models import SpecModels, hot_prompts

    key = hashlib.sha256(json.dumps([TARGET, DRAFT, K, 2]).encode()).hexdigest()[:12]
    d = root / key
    dirs = {"target": d / "target", "draft_model": d / "draft_model", "eagle3": d / "eagle3"}
    if not (d / "done").exists():
        m = SpecModels(**TARGET)
        m.write_target(dirs["target"])
        m.write_draft_model(dirs["draft_model"], layers=1, **DRAFT)
        m.write_eagle3(dirs["eagle3"])
        (d / "done").write_text("ok")
    return {k: str(v) for k, v in dirs.items()} | {"prompts": hot_prompts(64, PROMPT_LEN)}


def engine_kwargs(max_seqs: int) -> dict:
    return dict(dtype="bfloat16", max_model_len=512, max_num_seqs=max_seqs,
                max_num_batched_tokens=max(1024, max_seqs * (K + 1) * 2))


def measure(models, method, variant, concurrency, tokens, repeats, log_tokens) -> dict:
    """One engine: per concurrency C, a warm-up run then `repeats` timed runs of C
    prompts (tokens/s from the median, acceptance over the timed runs), the step log
    paused; then one logged run at C=8 (`log_tokens` new tokens): collective bytes
    per engine step by phase over its decode steps (those that drafted, under spec
    decoding)."""
    from commfold.distributed.comm_log import read_step_logs
    from commfold.vllm.observe.step_log import PAUSED
    from harness.vllm_engine import logits_gather_ms
    from harness.vllm_spec import engine, generate

    out = {"rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        env, spec = _setup(models, method, variant, Path(tmp))
        log_dir = Path(tmp) / "comm-log"
        log_dir.mkdir(parents=True)
        (log_dir / PAUSED).write_text("")
        with engine(models["target"], spec, env, **engine_kwargs(max(concurrency))) as llm:
            out["start_s"] = llm.start_s
            for c in concurrency:
                prompts = models["prompts"][:c]
                generate(llm, prompts, tokens)  # warm-up (the draft pick compiles here)
                runs = [generate(llm, prompts, tokens) for _ in range(repeats)]
                out["rows"].append(_row(c, runs))
                if env.get("COMMFOLD_VLLM") == "1" and env.get("COMMFOLD_TARGET_PICK") != "0":
                    out["rows"][-1]["pick_ab"] = _pick_ab(llm, prompts, tokens, repeats)
                out["rows"][-1]["collectives"] = llm.collective_rpc(
                    logits_gather_ms, args=(c,))[0]
            if log_tokens:
                (log_dir / PAUSED).unlink()
                generate(llm, models["prompts"][:8], log_tokens)
        if log_tokens:
            out["comm"] = _bytes_per_step(read_step_logs(log_dir).get(0, []), method)
    return out


def _pick_ab(llm, prompts, tokens, repeats) -> dict:
    """The target pick's own effect, drift cancelled: in this one engine, runs with the
    pick paused (vLLM's gather and sampler) and on, interleaved; ratio = the paused
    run's time / the pick's, median over pairs (> 1: the pick is faster)."""
    from harness.vllm_engine import pause_target_pick
    from harness.vllm_spec import generate

    times = {"vllm": [], "commfold": []}
    for _ in range(repeats):
        for name, paused in (("vllm", True), ("commfold", False)):
            llm.collective_rpc(pause_target_pick, args=(paused,))
            times[name].append(generate(llm, prompts, tokens)["seconds"])
    llm.collective_rpc(pause_target_pick, args=(False,))
    return times | {"ratio": statistics.median(a / b for a, b in zip(times["vllm"],
                                                                      times["commfold"]))}


def _row(c, runs) -> dict:
    acc = {k: sum(r["acceptance"][k] for r in runs) for k in ("drafts", "draft_tokens",
                                                                 "accepted")}
    acc["per_pos"] = [sum(x) for x in zip(*(r["acceptance"]["per_pos"] for r in runs))]
    secs = statistics.median(r["seconds"] for r in runs)
    return {"concurrency": c, "tokens_per_s": runs[0]["output_tokens"] / secs,
            "seconds": [r["seconds"] for r in runs], "acceptance": acc,
            "spread": (max(r["seconds"] for r in runs) - min(r["seconds"] for r in runs)) / secs,
            "tokens": runs[0]["tokens"],
            "same_every_run": all(r["tokens"] == runs[0]["tokens"] for r in runs)}


def _bytes_per_step(steps, method) -> dict:
    decode = [s for s in steps if s.info.get("tokens") and s.info["tokens"] <= 8 * (K + 1)
              and (method == "none" or s.in_phase("drafting").calls())]
    phases = ("forward", "logits", "sampling", "drafting", "other")
    per = {p: statistics.mean(s.in_phase(p).bytes() for s in decode) if decode else 0
           for p in phases}
    calls = statistics.mean(s.calls() for s in decode) if decode else 0
    picks = sorted({str(s.info.get("target_pick")) for s in decode})
    return {"steps": len(decode), "bytes_per_step": sum(per.values()), "by_phase": per,
            "calls_per_step": calls, "target_picks": picks}


# commfold as users get it: the fused norm's cost rule on (harness.vllm_engine's
# BASE_ENV turns it off to show every rewrite; --no-fuse-cost-rule does that here)
FUSE_COST_RULE = {"on": True}


def _setup(models, method, variant, log_dir):
    from harness.vllm_spec import engine_env, speculative_config

    env, local_argmax = variants()[variant]
    spec = None if method == "none" else speculative_config(method, models[method], K,
                                                             local_argmax)
    full = engine_env(env["COMMFOLD_VLLM"] == "1", log_dir, comm_log=log_dir is not None,
                      cache=Path(tempfile.gettempdir()) / "commfold-bench-vllm-cache")
    full.update({k: v for k, v in env.items() if k != "COMMFOLD_VLLM"})
    full["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(logits_gather_ms)
    full["COMMFOLD_FUSE_COST_RULE"] = "1" if FUSE_COST_RULE["on"] else "0"
    return full, spec


def plan(methods, chosen) -> list[tuple[str, str]]:
    """(method, variant) pairs: vLLM's local argmax only changes the draft pick."""
    return [(m, v) for m in methods for v in chosen
            if not (m == "none" and v == "vllm-local-argmax")]


# --- the results file, table and plot ------------------------------------------------

def load(out: Path) -> dict:
    try:
        return json.loads((out / "vllm_engine.json").read_text())
    except (OSError, ValueError):
        return {"runs": {}}


def save(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_engine.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "vllm_engine.md").write_text(markdown(results))
    plot(results, out / "vllm_engine.png")


def table_rows(results: dict) -> list[dict]:
    runs = results["runs"]
    rows = []
    for key, r in runs.items():
        method, variant = key.split("/")
        for row in r.get("rows", []):
            c = row["concurrency"]

            def tps(v, method=method, c=c):
                other = runs.get(f"{method}/{v}", {}).get("rows", [])
                return next((x["tokens_per_s"] for x in other if x["concurrency"] == c), None)

            base = runs.get(f"{method}/vllm", {}).get("rows", [])
            ref = next((x["tokens"] for x in base if x["concurrency"] == c), None)
            a = row["acceptance"]
            rows.append({"method": method, "variant": variant, "concurrency": c,
                         "tokens_per_s": row["tokens_per_s"], "vs_vllm": _ratio(row, tps("vllm")),
                         "vs_local_argmax": _ratio(row, tps("vllm-local-argmax")),
                         "acceptance": a["accepted"] / a["draft_tokens"] if a["draft_tokens"]
                         else None,
                         "per_pos": a["per_pos"],
                         "same_tokens": None if ref is None else row["tokens"] == ref,
                         "spread": row.get("spread"),
                         "gather_ms": row.get("collectives", {}).get("logits_ms"),
                         "pair_ms": row.get("collectives", {}).get("pair_ms"),
                         "pick_ab": row.get("pick_ab", {}).get("ratio"),
                         "date": row.get("date", r.get("date", "")),
                         "bytes_per_step": r.get("comm", {}).get("bytes_per_step"),
                         "drafting_bytes": _phase(r, "drafting"),
                         "pick_bytes": _phase(r, "logits", "sampling")})
    return rows


def _phase(run, *phases):
    by = run.get("comm", {}).get("by_phase")
    return None if by is None else sum(by.get(p, 0) for p in phases)


def _ratio(row, other):
    return None if not other else row["tokens_per_s"] / other


def markdown(results: dict) -> str:
    def f(x, fmt):
        return "" if x is None else format(x, fmt)

    lines = [f"# vLLM engine throughput, TP=2 ({results.get('meta', {}).get('date', '')})", "",
             "Output tokens/s of `LLM.generate` (median of the timed runs); spread = (slowest "
             "- fastest run) / median, the run-to-run noise; ratios to vLLM as "
             "shipped and to vLLM's hand-written local argmax (`use_local_argmax_reduction`); "
             "acceptance = accepted / drafted tokens; collective bytes per decode step per rank "
             "(rank 0's step log, one logged run at C=8 after the timed runs): all phases, "
             "the target's logits + pick, the drafting loop; the machine's collective speed, "
             "measured in the same engine after its timed runs: vLLM's all-gather of one "
             "step's logits ([C, vocab / 2], bf16) and of one (value, index) pair per row, "
             "median ms; pick A/B: in the commfold engine itself, runs with the target "
             "pick paused and on, interleaved (paused time / on time, median: > 1 means the "
             "pick is faster, engine-to-engine drift cancelled); the date of the engine's run.",
             "",
             "| method | variant | C | tok/s | spread | vs vLLM | vs vLLM local argmax "
             "| acceptance | same tokens | B/step | target pick B/step | drafting B/step "
             "| logits gather ms | pair gather ms | pick A/B | run |",
             "|" + "---|" * 16]
    for r in sorted(table_rows(results), key=lambda r: (METHODS.index(r["method"]),
                                                        r["concurrency"], r["variant"])):
        lines.append(f"| {r['method']} | {r['variant']} | {r['concurrency']} | "
                     f"{r['tokens_per_s']:.1f} | {f(r['spread'], '.0%')} | "
                     f"{f(r['vs_vllm'], '.3f')} | "
                     f"{f(r['vs_local_argmax'], '.3f')} | {f(r['acceptance'], '.2f')} | "
                     f"{'' if r['same_tokens'] is None else 'yes' if r['same_tokens'] else 'NO'} | "
                     f"{f(r['bytes_per_step'], ',.0f')} | {f(r['pick_bytes'], ',.0f')} | "
                     f"{f(r['drafting_bytes'], ',.0f')} | {f(r['gather_ms'], '.3f')} | "
                     f"{f(r['pair_ms'], '.3f')} | {f(r['pick_ab'], '.3f')} | {r['date'][:10]} |")
    meta = results.get("meta", {})
    lines += ["", f"Models: {meta.get('models', '')}", f"Machine: {meta.get('machine', '')}",
              f"Command: `{meta.get('command', '')}`"]
    if results.get("notes"):  # the reading of the numbers, kept in the JSON by hand
        lines += ["", results["notes"]]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in table_rows(results) if r["vs_vllm"] is not None]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    if not methods:
        return
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.6), squeeze=False)
    for ax, m in zip(axes[0], methods):
        mine = [r for r in rows if r["method"] == m]
        cs = sorted({r["concurrency"] for r in mine})
        vs = [v for v in variants() if any(r["variant"] == v for r in mine)]
        width = 0.8 / max(1, len(vs))
        for i, v in enumerate(vs):
            ys = [next((r["vs_vllm"] for r in mine if r["variant"] == v and r["concurrency"] == c),
                       0) for c in cs]
            ax.bar([j + i * width for j in range(len(cs))], ys, width, label=v)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + width * (len(vs) - 1) / 2 for j in range(len(cs))],
                      [f"C={c}" for c in cs])
        ax.set_title(f"spec decoding: {m}" if m != "none" else "no spec decoding")
        ax.set_ylabel("output tok/s vs vLLM")
        lo = min(r["vs_vllm"] for r in mine)
        ax.set_ylim(min(0.8, lo - 0.05), max(1.2, max(r["vs_vllm"] for r in mine) + 0.05))
        ax.legend(fontsize=7)
    fig.suptitle("vLLM engine, TP=2, 2-core CPU (bf16, V=151936)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                    choices=list(variants()))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-comm-log", action="store_true", help="skip the logged run")
    ap.add_argument("--no-fuse-cost-rule", action="store_true",
                    help="fuse every all-reduce + RMSNorm site, measured slower or not")
    ap.add_argument("--models", type=Path,
                    default=Path(tempfile.gettempdir()) / "commfold-bench-models")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--report", action="store_true", help="only rewrite table and plot")
    ap.add_argument("--shape", default="toy", choices=["toy", *SHAPES],
                    help="toy: the model above; else a real model's shape (seeded weights)")
    ap.add_argument("--layers", type=int, help="with --shape: cut the decoder to N layers")
    ap.add_argument("--runs", type=int, default=3,
                    help="with --shape: timed runs per row per round (their median)")
    ap.add_argument("--sequential", action="store_true",
                    help="with --shape: one engine at a time, alternating per round "
                         "(less memory; engines minutes apart), instead of both kept "
                         "and their runs paired")
    a = ap.parse_args(argv)
    if a.shape != "toy":
        FUSE_COST_RULE["on"] = not a.no_fuse_cost_rule
        return engine_shapes.main(a)
    results = load(a.out)
    if a.report:
        save(a.out, results)
        return 0
    from harness.vllm_engine import BASE_ENV

    os.environ.update(BASE_ENV)
    FUSE_COST_RULE["on"] = not a.no_fuse_cost_rule
    models = write_models(a.models)
    results["meta"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "models": f"target Llama {TARGET}, V=151936; draft_model 1 layer {DRAFT}; "
                  f"eagle3 1 layer, hidden {TARGET['hidden_size']}, draft vocab 32000; "
                  f"k={K}; {a.tokens} new tokens per prompt, {PROMPT_LEN}-token prompts; "
                  f"the fused norm's cost rule {'off' if a.no_fuse_cost_rule else 'on'}"}
    for method, variant in plan(a.methods, a.variants):
        key = f"{method}/{variant}"
        print(f"[vllm_engine] {key} ...", flush=True)
        r = measure(models, method, variant, a.concurrency, a.tokens, a.repeats,
                    0 if a.no_comm_log else 16)
        r["date"] = results["meta"]["date"]
        for row in r["rows"]:
            row["date"] = r["date"]
        # a rerun of some concurrencies keeps the others' rows (each row has its date)
        kept = [row | {"date": row.get("date", results["runs"][key].get("date", ""))}
                for row in results["runs"].get(key, {}).get("rows", [])
                if row["concurrency"] not in a.concurrency]
        r["rows"] = sorted(kept + r["rows"], key=lambda row: row["concurrency"])
        results["runs"][key] = r
        save(a.out, results)
        for row in r["rows"]:
            print(f"[vllm_engine] {key} C={row['concurrency']}: {row['tokens_per_s']:.1f} tok/s, "
                  f"acceptance {row['acceptance']}", flush=True)
    bad = [r for r in table_rows(results) if r["same_tokens"] is False]
    if bad:
        print(f"[vllm_engine] tokens differ from vLLM's: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
