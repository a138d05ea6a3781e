"""Speculative decoding on vLLM's real engine (TP=2, CPU), with and without commfold:
engine runs and what they show. Used by tools/vllm_spec_check.py (which the
engine test runs) and benchmarks/bench_vllm_engine.py.

One process runs its engines one after another (vLLM's parent-side state is per
engine; each engine spawns its own workers), so the parent's imports and vLLM's
model inspection are paid once. commfold is turned on the way users do it, with the
plugin (COMMFOLD_VLLM=1 in the workers' environment); COMMFOLD_REPORT_DIR and
COMMFOLD_COMM_LOG_DIR collect each rank's reports and per-step collectives.
"""
from __future__ import annotations

import gc
import json
import time
from contextlib import contextmanager
from pathlib import Path

from .vllm_engine import BASE_ENV, environ, fast_start_env, share_modelinfos

# variant -> (COMMFOLD_VLLM, use_local_argmax_reduction)
VARIANTS = {"off": (False, False), "vllm-local-argmax": (False, True), "commfold": (True, False),
            "commfold-local-argmax": (True, True)}
PICK_PASSES = ("replicate_vocab_parallel", "local_argmax")


def speculative_config(method: str | None, draft: str | None, k: int,
                       local_argmax: bool = False) -> dict | None:
    """vLLM's speculative_config; an MTP drafter (draft None) is the target's own."""
    if method is None:
        return None
    cfg = {"method": method, "num_speculative_tokens": k}
    if draft is not None:
        cfg["model"] = str(draft)
    if local_argmax:
        cfg["use_local_argmax_reduction"] = True
    return cfg


def engine_env(commfold: bool, out: Path | None, comm_log: bool = True,
               cache: Path | None = None) -> dict[str, str]:
    """The environment one engine's processes see: vLLM's CPU settings, commfold on
    or off, where its reports and step logs go, and vLLM's cache root (`cache`: a
    fresh one makes every graph compile, so commfold's passes run and report)."""
    env = {**BASE_ENV, **fast_start_env(), "COMMFOLD_VLLM": "1" if commfold else ""}
    if cache is not None:  # kernels shared by the engines of one cache (fast_start_env)
        env["VLLM_CACHE_ROOT"] = str(cache)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache) / "inductor")
    env["COMMFOLD_REPORT_DIR"] = str(out / "reports") if out else ""
    env["COMMFOLD_COMM_LOG_DIR"] = str(out / "comm-log") if out and comm_log else ""
    return env


@contextmanager
def engine(target: str, spec: dict | None, env: dict[str, str], **llm_kwargs):
    """One TP=2 engine started in this process's environment plus `env` (an empty
    value unsets a variable), stopped on exit; ``llm.start_s`` is its start-up time."""
    from vllm import LLM

    with environ(env):
        share_modelinfos()
        t0 = time.perf_counter()
        llm = LLM(model=target, tensor_parallel_size=2, distributed_executor_backend="mp",
                  seed=0, disable_log_stats=False, skip_tokenizer_init=True,
                  speculative_config=spec, **llm_kwargs)
        llm.start_s = time.perf_counter() - t0
        yield llm
        del llm
        gc.collect()


def generate(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy generation (ignore_eos) of all prompts at once: tokens, wall seconds,
    output tokens and the acceptance counters of this call."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    before = acceptance(llm)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"tokens": tokens, "seconds": seconds, "output_tokens": sum(map(len, tokens)),
            "acceptance": _minus(acceptance(llm), before)}


def run_engine(target: str, spec: dict | None, prompts: list[list[int]], max_tokens: int,
               env: dict[str, str], **llm_kwargs) -> dict:
    """One engine, one generation: tokens, acceptance and timings."""
    with engine(target, spec, env, **llm_kwargs) as llm:
        out = generate(llm, prompts, max_tokens)
        out["start_s"] = llm.start_s
    return out


def acceptance(llm) -> dict:
    """vLLM's spec-decode counters: drafts, draft tokens, accepted, accepted per
    position (zeros without spec decoding)."""
    names = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted",
             "vllm:spec_decode_num_accepted_tokens_per_pos": "per_pos"}
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] = list(m.values) if hasattr(m, "values") else int(m.value)
    return out


def _minus(a: dict, b: dict) -> dict:
    per_pos = [x - (b["per_pos"][i] if i < len(b["per_pos"]) else 0)
               for i, x in enumerate(a["per_pos"])]
    return {k: a[k] - b[k] for k in ("drafts", "draft_tokens", "accepted")} | {"per_pos": per_pos}


# --- what the runs show ----------------------------------------------------------

def rank_reports(out: Path) -> dict[int, list]:
    """rank -> its commfold Reports in compile order (one engine's COMMFOLD_REPORT_DIR)."""
    from commfold.report import Report

    by_rank: dict[int, list] = {}
    for f in sorted(Path(out, "reports").glob("*.json")):
        d = json.loads(f.read_text())
        by_rank.setdefault(d["rank"], []).append((d["graph_index"], Report.from_dict(d)))
    return {r: [rep for _, rep in sorted(reps, key=lambda x: x[0])] for r, reps in by_rank.items()}


def split_reports(reports: list) -> dict:
    """One rank's reports as {"model": [target, drafter], "picks": [...]}: the model
    graphs vLLM compiled (all passes; the target first) and the draft picks
    commfold compiled (the pick passes only)."""
    picks = [r for r in reports if tuple(r.passes) == PICK_PASSES]
    return {"model": [r for r in reports if tuple(r.passes) != PICK_PASSES], "picks": picks}


FINAL_NORMS = ("norm", "final_layernorm")  # Llama-family models; MTP layers (MiMo, DeepSeek)


def is_final_norm(rewrite) -> bool:
    """Whether a rewrite sits in a model's final norm (module path ``...norm`` /
    ``...final_layernorm``, not a layer's ``input_layernorm`` and the like)."""
    _, found, module = rewrite.location.rpartition(" in ")
    return bool(found) and module.rsplit(".", 1)[-1] in FINAL_NORMS


def drafting_gathers(steps, vocab_shard: int) -> dict:
    """Over one rank's engine steps: gathers in the drafting phase, the ones with
    vocab-wide rows (full-logit gathers), the most bytes per row any of them sent
    (a (value, index) int64 pair: 16), and the drafting phase's collective bytes per
    step that drafted."""
    drafting = [s.in_phase("drafting") for s in steps]
    drafted = [d for d, s in zip(drafting, steps) if s.info.get("tokens")]
    gathers = [e for d in drafting for e in d.events if e.name in ("all_gather", "gather")]
    wide = [e for d in drafting for e in d.vocab_gathers(vocab_shard)]
    return {"gathers": len(gathers), "vocab_gathers": len(wide),
            "row_bytes": max((e.bytes // max(1, e.elements) * s[-1] for e in gathers
                              for s in e.shapes if s), default=0),
            "bytes_per_step": (sum(d.bytes() for d in drafted) / len(drafted)) if drafted else 0,
            "steps": len(drafted)}
