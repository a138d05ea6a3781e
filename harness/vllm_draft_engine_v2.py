"""Probabilistic drafting on Model Runner V2's CPU runner, TP=2 (tests only): a target
and its early-exit drafter (harness.spec_models: seeded weights the drafter agrees
with often, not always) with ``draft_sample_method="probabilistic"``, so V2's
DraftModelSpeculator draws each draft token with ``gumbel_sample`` and caches the
draft logits, and the target verifies seeded sampled requests by "standard"
rejection sampling. Engines run one after another in this process
(``python -m harness.vllm_draft_engine_v2 OUT '<json runs>'``, each run the
environment it adds: a TOKENS_MARK line). Run it with harness.triton_cpu's
v2_engine_env()."""
from __future__ import annotations

import sys
from pathlib import Path

from harness.vllm_engine import TOKENS_MARK  # noqa: F401  (the tests read it here)
K, VOCAB, HOT = 2, 32000, 16000  # draft steps; vocab (shards of 16000 at TP=2)
SAMPLING = dict(temperature=0.8, seed=7, repetition_penalty=1.1)


def write_models(out: Path):
    from harness.spec_models import SpecModels

    models = SpecModels(vocab_size=VOCAB, hot=HOT)
    return (models.write_target(out / "target"), models.write_draft_model(out / "draft"),
            models.prompts(3))


def run(target: Path, draft: Path, prompts, max_tokens: int = 10) -> dict:
    from vllm import LLM

    from harness.vllm_engine import greedy_run

    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic"}
    return greedy_run(lambda: LLM(
        model=str(target), tensor_parallel_size=2, dtype="bfloat16",
        distributed_executor_backend="mp", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=128, seed=0, disable_log_stats=False,
        skip_tokenizer_init=True, speculative_config=spec), prompts, max_tokens,
        detokenize=False, **SAMPLING)


if __name__ == "__main__":
    from harness.vllm_engine import serve_runs

    target, draft, prompts = write_models(Path(sys.argv[1]))
    serve_runs(lambda env: run(target, draft, prompts), sys.argv[2])
