"""vLLM engines with LoRA at TP=2 (tests only): a tiny Llama with seeded weights and a
rank-8 adapter on q/k/v/o/gate/up/down written offline with a seed (the PEFT files vLLM
loads: adapter_config.json + adapter_model.safetensors; no peft needed), served with
``--lora-target-modules`` naming those projections (so no adapter can touch the LM
head: commfold.vllm.target.lora_head). Each run generates PROMPTS greedily twice in one
batch, with the adapter and without, then once more without it alone.
``python -m harness.vllm_lora TMP '<json runs>'`` (each run: the environment it adds): a
TOKENS_MARK line (harness.vllm_engine).

``max_loras=2`` though one adapter is served: vLLM's CPU LoRA ops (vllm/lora/ops/torch_ops,
0.32) gather each token's adapter slot by index, and a request without an adapter has
index -1, which Python's indexing reads as the last slot. With one slot that is the
served adapter, so in a batch mixing both kinds every request gets the adapter (a batch
without adapter requests skips LoRA and is right). With two, the adapter takes slot 0 and
-1 reads slot 1, all zeros: the requests without it get the base model's tokens."""
from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, model: Path, seed: int = 0) -> Path:
    """A PEFT LoRA adapter of `model` (a harness.tiny_models Llama) on TARGETS, rank 8,
    A and B drawn with `seed` (B nonzero, unlike a fresh PEFT adapter: it changes tokens)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter),
              "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    where = {t: "self_attn" if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
             for t in TARGETS}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in TARGETS:
            fan_in, fan_out = shapes[t]
            name = f"base_model.model.model.layers.{layer}.{where[t]}.{t}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) \
                / fan_in ** 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=RANK, lora_alpha=2 * RANK,
        lora_dropout=0.0, bias="none", target_modules=list(TARGETS),
        base_model_name_or_path=str(model), fan_in_fan_out=False, modules_to_save=None)))
    return out


def run(model: Path, adapter: Path, max_tokens: int = 8) -> dict:
    """Greedy tokens of PROMPTS with the adapter (``adapter``) and without it
    (``base``) in one batch, then without it in a batch of their own (``alone``)."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from harness.vllm_models import PROMPTS

    llm = LLM(model=str(model), tensor_parallel_size=2, dtype="bfloat16", max_model_len=128,
              max_num_seqs=8, max_num_batched_tokens=128, seed=0,
              distributed_executor_backend="mp", enable_lora=True, max_lora_rank=RANK,
              max_loras=2, lora_target_modules=list(TARGETS))
    lora = LoRARequest("seeded", 1, str(adapter))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS * 2, params,
                        lora_request=[lora] * len(PROMPTS) + [None] * len(PROMPTS))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    alone = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    del llm
    return dict(adapter=tokens[:len(PROMPTS)], base=tokens[len(PROMPTS):], alone=alone)


if __name__ == "__main__":
    from harness.tiny_models import write_model
    from harness.vllm_engine import serve_runs

    tmp = Path(sys.argv[1])
    model = write_model(tmp / "model", "llama", weights=True)
    adapter = write_adapter(tmp / "adapter", model)
    serve_runs(lambda env: run(model, adapter), sys.argv[2])
