"""Real model shapes on vLLM's engine (TP=2, bf16): vLLM as shipped vs
commfold vs commfold with the target pick off, greedy and ``logprobs=5`` traffic,
side by side in one run. The machine drifts (its cores change speed by ~25% for
minutes at a time), so the variants are paired: both engines are started once and
kept, and per round and (traffic, C) the three variants run back to back, seconds
apart (``run_paired``; ``--sequential``: one engine at a time, alternating per round,
for less memory). The pick-off variant is commfold's engine with the target pick
paused (vLLM's gather and sampler). Each figure is the median of ``--runs`` timed
runs; ``vs_vllm`` is the median of the per-round ratios.

    python -m benchmarks.bench_vllm_engine --shape llama-3.2-1b --layers 4

Models are written offline (harness.tiny_models: config, a small tokenizer and seeded
weights at transformers' initialization scale; see SEEDED). ``--layers`` cuts the
decoder (the vocabulary, hidden size and head are the real ones); the results file
says how many layers ran.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

# shape -> (tiny_models arch, the Hugging Face config's sizes)
SHAPES = {
    "llama-3.2-1b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "llama-3.2-3b": ("llama", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "qwen3-1.7b": ("qwen3", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
}
NO_PICK = "commfold-no-target-pick"
VARIANTS = ("vllm", "commfold", NO_PICK)
TRAFFIC = {"greedy": {}, "logprobs=5": {"logprobs": 5}}
PROMPT_LEN = 16
# Seeded weights at transformers' initialization scale (logits spread like a real
# model's), not vLLM's dummy +-1e-3: those give logits of ~1e-5, where nearly every
# pair of logprobs is a near-tie and commfold's logprobs pick hands every row back to
# vLLM's gather after its own exchanges (paying both; docs/performance.md,
# "Real model shapes").
SEEDED = True


def write_shape(root: Path, shape: str, layers: int | None, seeded: bool = SEEDED) -> Path:
    """The model directory of `shape` (`layers` decoder layers; None: all), written once:
    seeded random weights at a real model's scale, or (seeded False) a config only,
    for vLLM's dummy weights (harness.tiny_models.load_format tells which)."""
    from harness.tiny_models import write_model

    arch, sizes = SHAPES[shape]
    sizes = dict(sizes, max_position_embeddings=4096)
    if layers:
        sizes["num_hidden_layers"] = layers
    d = root / f"{shape}-L{sizes['num_hidden_layers']}{'-seeded' if seeded else ''}"
    if not (d / "done").exists():
        write_model(d, arch=arch, weights=seeded, **sizes)
        if seeded:
            _bf16(d)
        (d / "done").write_text("ok")
    return d


def _bf16(d: Path) -> None:
    """The weights file in bf16 (written in float32): half the bytes to load, and half
    the loader's peak memory on a machine shared with other engines."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    f = d / "model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(f).items()},
              f, metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"dtype": "bfloat16"}, indent=2))


def prompts(n: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


def generate(llm, batch, tokens: int, traffic: str) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            detokenize=False, **TRAFFIC[traffic])
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    toks = [list(o.outputs[0].token_ids) for o in outs]
    return {"seconds": secs, "output_tokens": sum(map(len, toks)), "tokens": toks}


def timed(llm, batch, tokens: int, traffic: str, runs: int) -> dict:
    """`runs` timed generations of one batch: the round's figure is their median time
    (a single short run on this 2-core machine, where four processes spin on shared
    memory, is off by up to ~10% either way), every run's time kept; tokens must agree."""
    each = [generate(llm, batch, tokens, traffic) for _ in range(runs)]
    assert all(x["tokens"] == each[0]["tokens"] for x in each), "runs disagree on tokens"
    secs = [x["seconds"] for x in each]
    return dict(each[0], seconds=statistics.median(secs), runs_s=secs)


@contextmanager
def open_engine(model: Path, engine_variant: str, concurrency, tokens):
    """vLLM's engine as shipped ("vllm") or commfold's ("commfold"), started for these
    runs and stopped on exit."""
    from benchmarks.bench_vllm_engine import FUSE_COST_RULE
    from harness.tiny_models import load_format
    from harness.vllm_spec import engine, engine_env

    env = engine_env(engine_variant == "commfold", None, comm_log=False,
                     cache=Path(tempfile.gettempdir()) / "commfold-bench-shapes-cache")
    env["COMMFOLD_FUSE_COST_RULE"] = "1" if FUSE_COST_RULE["on"] else "0"
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(pause_target_pick)
    c_max = max(concurrency)
    with engine(str(model), None, env, dtype="bfloat16", load_format=load_format(model),
                max_model_len=PROMPT_LEN + tokens + 16, max_num_seqs=c_max,
                max_num_batched_tokens=max(2048, c_max * PROMPT_LEN)) as llm:
        yield llm


def _select(llm, variant: str) -> None:
    """In commfold's engine, the target pick on (commfold) or paused (NO_PICK)."""
    from harness.vllm_engine import pause_target_pick

    if variant != "vllm":
        llm.collective_rpc(pause_target_pick, args=(variant == NO_PICK,))


def one_engine(model: Path, engine_variant: str, concurrency, tokens, warmup, r,
               runs: int = 1) -> dict:
    """One engine: vLLM as shipped, or commfold. Per (traffic, C) a warm-up run of
    `warmup` tokens, then `runs` timed runs (their median: `timed`); in commfold's
    engine, as many with the target pick paused too (vLLM's gather and sampler on
    commfold's compiled forward), the two variants in an order alternating with the
    round `r`. Returns {variant: {traffic/C: run}} and the start-up seconds."""
    commfold = engine_variant == "commfold"
    names = ["commfold", NO_PICK][::1 if r % 2 == 0 else -1] if commfold else ["vllm"]
    out: dict[str, dict] = {v: {} for v in names}
    with open_engine(model, engine_variant, concurrency, tokens) as llm:
        all_prompts = prompts(max(concurrency), llm.llm_engine.model_config.get_vocab_size())
        for traffic in TRAFFIC:
            for c in concurrency:
                generate(llm, all_prompts[:c], warmup, traffic)
                for v in names:
                    _select(llm, v)
                    out[v][f"{traffic}/{c}"] = timed(llm, all_prompts[:c], tokens, traffic,
                                                    runs)
        _select(llm, "commfold" if commfold else "vllm")
        start = llm.start_s
    return {"runs": out, "start_s": start}


# vLLM's workers spin on shared memory for 1 s after their last step (SpinCondition's
# busy_loop_s) before they sleep: the engine not timed is left that long first
IDLE_S = 1.5


def run_paired(shape, layers, concurrency, tokens, rounds, warmup=4, log=print,
               runs=1) -> dict:
    """Both engines started once and kept; per round and (traffic, C), the three
    variants timed back to back (the order rotating with the round), each after the
    other engine went idle. This VM's cores change speed by ~25% for minutes at a
    time (its neighbours' load, invisible from inside: the same engine, same runs,
    read 48 then 36 tok/s), so runs seconds apart are compared, not engines minutes
    apart."""
    model = write_shape(Path(tempfile.gettempdir()) / "commfold-bench-shapes", shape, layers)
    raw: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    log(f"[shapes] {shape}: starting vLLM's engine and commfold's (paired) ...")
    with open_engine(model, "vllm", concurrency, tokens) as plain, \
            open_engine(model, "commfold", concurrency, tokens) as mine:
        start = {"vllm": [plain.start_s], "commfold": [mine.start_s]}
        all_prompts = prompts(max(concurrency), plain.llm_engine.model_config.get_vocab_size())
        for r in range(rounds):
            got: dict[str, dict] = {v: {} for v in VARIANTS}
            for traffic in TRAFFIC:
                for c in concurrency:
                    batch = all_prompts[:c]
                    order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
                    for v in order:
                        llm = plain if v == "vllm" else mine
                        _select(llm, v)
                        time.sleep(IDLE_S)
                        if r == 0 and v != NO_PICK:
                            generate(llm, batch, warmup, traffic)
                        got[v][f"{traffic}/{c}"] = timed(llm, batch, tokens, traffic, runs)
            for v in VARIANTS:
                raw[v].append(got[v])
            log(f"[shapes] {shape} round {r + 1}/{rounds}: " + "; ".join(
                f"{v} " + ", ".join(f"{k} {x['output_tokens'] / x['seconds']:.1f}"
                                    for k, x in got[v].items()) for v in VARIANTS))
        _select(mine, "commfold")
    return {"rows": rows(raw, concurrency), "start_s": start}


def run(shape, layers, concurrency, tokens, rounds, warmup=4, log=print, runs=1) -> dict:
    """Every round: vLLM's engine and commfold's, one at a time, the order alternating;
    the rows from them."""
    model = write_shape(Path(tempfile.gettempdir()) / "commfold-bench-shapes", shape, layers)
    raw: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    start: dict[str, list[float]] = {"vllm": [], "commfold": []}
    for r in range(rounds):
        for ev in (["vllm", "commfold"] if r % 2 == 0 else ["commfold", "vllm"]):
            log(f"[shapes] {shape} round {r + 1}/{rounds}: {ev} engine ...")
            e = one_engine(model, ev, concurrency, tokens, warmup, r, runs)
            start[ev].append(e["start_s"])
            for v, timings in e["runs"].items():
                raw[v].append(timings)
                log(f"[shapes] {v}: " + ", ".join(
                    f"{k} {x['output_tokens'] / x['seconds']:.1f} tok/s"
                    for k, x in timings.items()))
    return {"rows": rows(raw, concurrency), "start_s": start}


def rows(raw: dict, concurrency) -> list[dict]:
    out = []
    base = raw.get("vllm")
    for v, engines in raw.items():
        for traffic in TRAFFIC:
            for c in concurrency:
                key = f"{traffic}/{c}"
                runs = [e[key] for e in engines]
                secs = [x["seconds"] for x in runs]
                med = statistics.median(secs)
                row = {"variant": v, "traffic": traffic, "concurrency": c,
                       "tokens_per_s": runs[0]["output_tokens"] / med, "seconds": secs,
                       "spread": (max(secs) - min(secs)) / med}
                if base:
                    ref = [e[key] for e in base]
                    row["vs_vllm"] = statistics.median(
                        b["seconds"] / x["seconds"] for b, x in zip(ref, runs))
                    row["vs_vllm_each"] = [b["seconds"] / x["seconds"]
                                           for b, x in zip(ref, runs)]
                    row["same_tokens"] = all(b["tokens"] == x["tokens"]
                                             for b, x in zip(ref, runs))
                out.append(row)
    return out


def pick_ab(rows: list[dict], row: dict) -> float | None:
    """The target pick's own effect, drift cancelled: in commfold's engine, the paused
    run's time / the pick's (the two ran back to back), median over rounds."""
    off = next((x for x in rows if x["variant"] == NO_PICK and x["traffic"] == row["traffic"]
                and x["concurrency"] == row["concurrency"]), None)
    if off is None:
        return None
    return statistics.median(a / b for a, b in zip(off["seconds"], row["seconds"]))


def markdown(results: dict) -> str:
    lines = ["# vLLM engine at real model shapes, TP=2, bf16", "",
             "Output tokens/s of `LLM.generate` (the median over rounds; each round starts "
             "vLLM's engine and commfold's, one at a time, the order alternating; "
             "commfold-no-target-pick is commfold's engine with the target pick paused, "
             "timed next to the pick's run); vs vLLM = the median "
             "of the per-round ratios (vLLM's time / the variant's), each round's ratios "
             "listed; spread = (slowest - fastest round) / median. Greedy tokens equal "
             "vLLM's where `same tokens` says yes. Pick A/B: in commfold's engine, the "
             "run with the target pick paused / the run with it on, back to back, median "
             "over rounds (> 1: the pick is faster; engine-to-engine drift cancelled).",
             ""]
    for shape, r in results.get("shapes", {}).items():
        lines += [f"## {shape} ({r['layers']} of {r['full_layers']} layers), {r['date']}", "",
                  f"Config: {r['config']}; weights: {r.get('weights', '')}; "
                  f"{r.get('tokens')} new tokens per prompt, {r.get('prompt_len')}-token prompts; "
                  f"{r.get('runs_per_round', 1)} timed run(s) per row per round, their median; "
                  f"engines: {r.get('engines', 'one at a time, alternating')}",
                  f"Command: `{r['command']}`", "",
                  "| traffic | C | variant | tok/s | spread | vs vLLM | per round | "
                  "same tokens | pick A/B |", "|" + "---|" * 9]
        for row in sorted(r["rows"], key=lambda x: (x["traffic"], x["concurrency"],
                                                    x["variant"])):
            same = row.get("same_tokens")
            ab = pick_ab(r["rows"], row) if row["variant"] == "commfold" else None
            lines.append(
                f"| {row['traffic']} | {row['concurrency']} | {row['variant']} | "
                f"{row['tokens_per_s']:.1f} | {row['spread']:.0%} | "
                f"{row.get('vs_vllm', 0):.3f} | "
                f"{' '.join(f'{x:.2f}' for x in row.get('vs_vllm_each', []))} | "
                f"{'' if same is None else 'yes' if same else 'NO'} | "
                f"{'' if ab is None else format(ab, '.3f')} |")
        lines += ["", f"Engine start-up seconds: {r['start_s']}", ""]
        if r.get("notes"):
            lines += [r["notes"], ""]
    return "\n".join(lines) + "\n"


def main(a) -> int:
    """--shape other than toy: run, merge into vllm_shapes.json, rewrite the table."""
    import json

    from harness.vllm_engine import BASE_ENV

    os.environ.update(BASE_ENV)
    path = a.out / "vllm_shapes.json"
    results = json.loads(path.read_text()) if path.exists() else {"shapes": {}}
    arch, sizes = SHAPES[a.shape]
    layers = a.layers or sizes["num_hidden_layers"]
    how = run if a.sequential else run_paired
    r = how(a.shape, a.layers, a.concurrency, a.tokens, a.repeats,
            log=lambda s: print(s, flush=True), runs=a.runs)
    r.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             layers=layers, full_layers=sizes["num_hidden_layers"],
             config=f"{arch} {dict(sizes, num_hidden_layers=layers)}",
             weights="seeded (transformers' init scale)" if SEEDED else "vLLM's dummy",
             machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
             tokens=a.tokens, prompt_len=PROMPT_LEN, runs_per_round=a.runs,
             engines="one at a time, alternating" if a.sequential else "both kept, paired runs",
             command="python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]))
    old = results["shapes"].get(a.shape, {})
    if old.get("notes"):
        r["notes"] = old["notes"]
    results["shapes"][a.shape] = r
    a.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    (a.out / "vllm_shapes.md").write_text(markdown(results))
    return 0
