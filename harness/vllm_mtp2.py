"""vLLM's multi-module MTP speculative decoding on Model Runner V2's CPU runner, TP=2
(tests only): a tiny DeepSeek-V3 with two MTP layers and num_speculative_tokens=2,
so vLLM builds its ``MultiModuleMTPSpeculator`` (one MTP layer, with its own shared
head, per draft step). Written offline, vLLM's dummy weights; engines run one after
another in this process (``python -m harness.vllm_mtp2 OUT '<json runs>'``, each run
the environment it adds, ``local_argmax`` for use_local_argmax_reduction and
``sampled`` for probabilistic drafts serving seeded sampled requests: a TOKENS_MARK
line). Run it with harness.triton_cpu.v2_engine_env()."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.vllm_engine import TOKENS_MARK  # noqa: F401  (the tests read it here)
K, VOCAB = 2, 1000  # draft steps (one per MTP layer), vocab (padded: 1024 at TP=2)
# a small DeepSeek-V3: MLA (kv_lora_rank + qk_rope_head_dim = 320, a head size vLLM's
# MLA takes), one dense layer then a MoE layer, two MTP layers
CONFIG = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
              num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
              kv_lora_rank=256, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
              v_head_dim=32, max_position_embeddings=512, num_nextn_predict_layers=K,
              rope_scaling=None, tie_word_embeddings=False)


def write_model(out: Path) -> Path:
    from harness.tiny_models import write_model as write

    path = write(out / "deepseek_v3", "llama", vocab_size=VOCAB)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("head_dim", "num_key_value_heads", "rope_theta", "rope_parameters"):
        cfg.pop(key, None)
    cfg.update(CONFIG, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
               topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
               rope_theta=10000.0, num_key_value_heads=CONFIG["num_attention_heads"])
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def prompts(n: int = 3, length: int = 6) -> list[list[int]]:
    from harness.spec_models import hot_prompts

    return hot_prompts(n, length, VOCAB)


def run(model: Path, local_argmax: bool, max_tokens: int = 10, sampled: bool = False
        ) -> dict:
    """One engine's tokens; sampled: probabilistic drafts and seeded sampled requests
    (harness.vllm_draft_engine_v2's SAMPLING), else greedy."""
    from vllm import LLM

    from harness.vllm_draft_engine_v2 import SAMPLING
    from harness.vllm_engine import greedy_run

    spec = {"method": "mtp", "num_speculative_tokens": K}
    if local_argmax:
        spec["use_local_argmax_reduction"] = True
    if sampled:
        spec["draft_sample_method"] = "probabilistic"
    return greedy_run(lambda: LLM(
        model=str(model), tensor_parallel_size=2, dtype="bfloat16",
        distributed_executor_backend="mp", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=128, seed=0, disable_log_stats=False, load_format="dummy",
        skip_tokenizer_init=True, speculative_config=spec), prompts(), max_tokens,
        detokenize=False, **(SAMPLING if sampled else {}))


if __name__ == "__main__":
    from harness.vllm_engine import serve_runs

    model = write_model(Path(sys.argv[1]))
    flags: list[tuple[bool, bool]] = []  # each run's (local_argmax, sampled), off its env

    def label(env: dict) -> tuple:
        flags.append((bool(env.pop("local_argmax", False)), bool(env.pop("sampled", False))))
        return flags[-1]

    serve_runs(lambda env: run(model, flags[-1][0], sampled=flags[-1][1]), sys.argv[2],
               label)
