"""Engines for benchmarks/bench_traffic_bytes.py: one TP=2 vLLM CPU engine per run,
the toy target of harness.spec_models at a real vocab size (its collectives per
step depend on vocab, batch and dtype, not on depth), generating each traffic kind
at each concurrency in turn, the step log on (COMMFOLD_COMM_LOG_DIR).

    python -m harness.vllm_traffic TMP '<json runs>'   # via harness.vllm_engine.engine_runs

A run's environment names what it is (besides COMMFOLD_VLLM and the runner):
TRAFFIC_VOCAB, TRAFFIC_SHARDED=1 (vLLM's enable_batch_sharded_sampling),
TRAFFIC_SPEC=1 (a draft_model drafter drawing its drafts, draft_sample_method
"probabilistic"), TRAFFIC_KINDS and TRAFFIC_C (comma lists; TRAFFIC_C_SAMPLED: the
sampled kinds' concurrencies, if fewer). The calls run in
that order (kinds inside concurrencies); each call's steps are the lines its ranks
added to the step log while it ran (a worker writes a step's line before the step's
output reaches the engine): ``calls`` gives each call's line range.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

PROMPT_LEN, MAX_TOKENS, K = 6, 3, 2  # prompt tokens; new tokens per request; drafts
CHAT = dict(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
            presence_penalty=0.3, frequency_penalty=0.2)
KINDS = {
    "greedy": dict(temperature=0.0),
    "greedy+logprobs": dict(temperature=0.0, logprobs=5),
    "chat-top-p": CHAT,
    "chat-top-k": {**CHAT, "top_p": 1.0, "top_k": 50},
    "chat+logprobs": {**CHAT, "logprobs": 5},
    # sampled drafts (the spec runs): what commfold's drafter and verifier draw from
    # the shards (temperature, seeds, a penalty)
    "spec-sampled": dict(temperature=0.8, repetition_penalty=1.1),
}
HIDDEN = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def params(kind: str, i: int) -> dict:
    """SamplingParams of request i of a call: the kind's, seeded where it samples."""
    p = dict(KINDS[kind], max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    return p | ({"seed": 1000 + i} if p["temperature"] else {})


def write_models(root: Path, vocab: int) -> tuple[Path, Path, list[list[int]]]:
    from harness.spec_models import SpecModels

    d = root / f"models-{vocab}"
    m = SpecModels(vocab_size=vocab, **HIDDEN)
    if not (d / "done").exists():
        m.write_target(d / "target")
        m.write_draft_model(d / "draft")
        (d / "done").write_text("ok")
    return d / "target", d / "draft", m.prompts(64, PROMPT_LEN)


def run(root: Path, env: dict) -> dict:
    """One engine: every kind at every concurrency, MAX_TOKENS each; the tokens'
    lengths and the call order back (the bytes are in the step log)."""
    from vllm import LLM, SamplingParams

    vocab = int(env["TRAFFIC_VOCAB"])
    target, draft, prompts = write_models(root, vocab)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic"} if env.get("TRAFFIC_SPEC") else None
    extra = {"enable_batch_sharded_sampling": True} if env.get("TRAFFIC_SHARDED") else {}
    cs = [int(c) for c in env["TRAFFIC_C"].split(",")]
    # sampled kinds' concurrencies (V2's sampling kernels run interpreted here)
    sampled_cs = [int(c) for c in env.get("TRAFFIC_C_SAMPLED", env["TRAFFIC_C"]).split(",")]
    llm = LLM(model=str(target), tensor_parallel_size=2, dtype="bfloat16",
              distributed_executor_backend="mp", max_model_len=64, max_num_seqs=max(cs),
              max_num_batched_tokens=max(512, max(cs) * PROMPT_LEN), seed=0,
              skip_tokenizer_init=True, speculative_config=spec, enforce_eager=True,
              max_logprobs=5, **extra)
    log = Path(env["COMMFOLD_COMM_LOG_DIR"]) / "rank0.jsonl"
    calls = []
    for c in cs:
        for kind in env["TRAFFIC_KINDS"].split(","):
            if KINDS[kind]["temperature"] and c not in sampled_cs:
                continue
            first = _lines(log)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:c]],
                                [SamplingParams(**params(kind, i)) for i in range(c)],
                                use_tqdm=False)
            calls.append(dict(kind=kind, c=c, lines=[first, _lines(log)],
                              tokens=sum(len(o.outputs[0].token_ids) for o in outs)))
    del llm
    return dict(calls=calls, vocab=vocab)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


if __name__ == "__main__":
    from harness.vllm_engine import serve_runs

    root = Path(sys.argv[1])
    serve_runs(lambda env: run(root, {**os.environ, **env}), sys.argv[2])
