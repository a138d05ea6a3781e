"""vLLM's DSpark speculative decoding on Model Runner V2's CPU runner, TP=2 (tests
only): a tiny Qwen3 target and a ``Qwen3DSparkModel`` draft written offline, engines
run one after another in this process (``python -m harness.vllm_dspark OUT '<json
runs>'``, each run the environment it adds: a TOKENS_MARK line). Run it with
harness.triton_cpu.v2_engine_env(); HARNESS_DSPARK_SHARDED=1 builds the Markov head
sharded (harness/dspark_sharded.py).

Seeded weights, not vLLM's dummy ones: with dummy weights the draft's fused
context-K/V weight is built at its first forward (qwen3_dflash.py,
precompute_and_store_context_kv), after vLLM CPU packed its qkv_proj and left an
empty ``weight`` (linear.py, dispatch_cpu_unquantized_gemm(remove_weight=True)), and
the start fails ("size mismatch ... vec (0)"); a checkpoint builds it in load_weights.
The target follows a permutation of the vocab (harness.spec_models); the draft's
Markov head scores the same permutation (``markov_w2[perm[t]] = markov_w1[t]``, large
enough to outweigh the base logits), so its drafts are accepted most of the time and
depend on both Markov layers: the acceptance counters compare the heads' drafts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.spec_models import SpecModels, _save
from harness.tiny_models import SIZES, write_model

from harness.vllm_engine import TOKENS_MARK  # noqa: F401  (the tests read it here)
K, VOCAB, RANK = 3, 1000, 64  # draft block (num_speculative_tokens), vocab, Markov rank
# one Qwen3 layer over the target's layers 0 and 1 (their outputs); noise token in vocab
DRAFT = dict(architectures=["Qwen3DSparkModel"], block_size=K,
             dspark_target_layer_ids=[0, 1], use_aux_hidden_state=True, markov_rank=RANK,
             dspark_noise_token_id=VOCAB - 1, enable_confidence_head=False)


def write_models(out: Path) -> tuple[Path, Path, list[list[int]]]:
    """(target dir, draft dir, prompts)."""
    import torch

    models = SpecModels(vocab_size=VOCAB, hot=VOCAB)
    h, hd, layers = SIZES["hidden_size"], SIZES["head_dim"], SIZES["num_hidden_layers"]
    target = write_model(out / "target", "qwen3", vocab_size=VOCAB)
    w = models._weights(layers)
    for i in range(layers):
        w.update({f"model.layers.{i}.self_attn.{n}.weight": torch.ones(hd)
                  for n in ("q_norm", "k_norm")})
    _save(w, target)

    draft = write_model(out / "draft", "qwen3", vocab_size=VOCAB, num_hidden_layers=1)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, **DRAFT}, indent=1))
    g = torch.Generator().manual_seed(1)
    w = {f"layers.0.{k}": v for k, v in models._layer(g, models.sigma, 1).items()}
    w.update({f"layers.0.{n}.weight": torch.ones(hd) for n in ("self_attn.q_norm",
                                                              "self_attn.k_norm")})
    w.update({f"{n}.weight": torch.ones(h) for n in ("layers.0.input_layernorm",
                                                     "hidden_norm", "norm")})
    w["fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.02
    m1 = torch.randn(VOCAB, RANK, generator=g)
    m1 = 5 * m1 / m1.norm(dim=1, keepdim=True)  # a bias of 25 on perm[prev]
    w["markov_head.markov_w1.weight"] = m1
    w["markov_head.markov_w2.weight"] = m1[models.inv]
    _save(w, draft)
    return target, draft, models.prompts(3)


def run(target: Path, draft: Path, prompts: list[list[int]], max_tokens: int = 12) -> dict:
    from vllm import LLM

    from harness.vllm_engine import greedy_run

    return greedy_run(lambda: LLM(
        model=str(target), tensor_parallel_size=2, dtype="bfloat16",
        distributed_executor_backend="mp", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=128, seed=0, disable_log_stats=False,
        speculative_config={"method": "dspark", "model": str(draft),
                            "num_speculative_tokens": K}), prompts, max_tokens)


if __name__ == "__main__":
    from harness.vllm_engine import serve_runs

    target, draft, prompts = write_models(Path(sys.argv[1]))
    serve_runs(lambda env: run(target, draft, prompts), sys.argv[2])
