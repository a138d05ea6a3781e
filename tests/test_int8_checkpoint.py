"""harness.int8_checkpoint: the offline int8 W8A8 checkpoint the int8 engine pair
(tests/test_vllm_int8_engine.py) serves. Its weights and scales round-trip through
compressed-tensors' own int-quantized compressor (the library vLLM and llm-compressor
read and write the format with), its quantization_config parses as that library's
QuantizationConfig, and vLLM 0.32's compressed-tensors config picks its int8 W8A8
scheme (per channel, dynamic per-token inputs) for every decoder Linear and none for
the ignored LM head. That vLLM's loader loads the file is the engine test's part."""
from __future__ import annotations

import json

import pytest

from harness.int8_checkpoint import LINEARS, QUANTIZATION_CONFIG, write_int8_model
from harness.tiny_models import SIZES, write_model
from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import load_file

    tmp = tmp_path_factory.mktemp("int8")
    path = write_int8_model(tmp / "int8", "llama")
    floats = load_file(write_model(tmp / "float", "llama", weights=True) / "model.safetensors")
    return dict(path=path, tensors=load_file(path / "model.safetensors"), floats=floats)


def _quantized(tensors) -> list[str]:
    return sorted(n for n in tensors if n.endswith(".weight_scale"))


def test_every_decoder_linear_int8_with_channel_scales(checkpoint):
    import torch

    t = checkpoint["tensors"]
    scaled = _quantized(t)
    assert len(scaled) == len(LINEARS) * SIZES["num_hidden_layers"]
    for name in scaled:
        w = t[name.removesuffix("_scale")]
        assert w.dtype == torch.int8 and t[name].dtype == torch.float32
        assert t[name].shape == (w.shape[0], 1)
        # symmetric per channel: each row's largest magnitude is 127 (or -128 at most)
        assert torch.all(w.abs().amax(dim=1) == 127), name
    rest = {n: x.dtype for n, x in t.items() if x.dtype != torch.int8 and n not in scaled}
    assert "lm_head.weight" in rest and set(rest.values()) == {torch.bfloat16}, rest
    config = json.loads((checkpoint["path"] / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG


def test_weights_and_scales_round_trip_through_compressed_tensors(checkpoint):
    """compressed-tensors' IntQuantizationCompressor, given the seeded float weight and
    our scale, writes our int8 weight; its decompress gives int8 x scale, within half
    a step of the float weight."""
    import torch
    from compressed_tensors.compressors.naive_quantized.base import \
        IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(QUANTIZATION_CONFIG)
    scheme = qc.config_groups["group_0"]
    assert IntQuantizationCompressor.can_compress(torch.nn.Linear, scheme)
    t, floats = checkpoint["tensors"], checkpoint["floats"]
    for name in _quantized(t):
        weight, scale = name.removesuffix("_scale"), t[name]
        ours = t[weight]
        theirs = IntQuantizationCompressor.compress(
            {"weight": floats[weight], "weight_scale": scale}, scheme)
        assert torch.equal(theirs["weight"], ours), weight
        back = IntQuantizationCompressor.decompress({"weight": ours, "weight_scale": scale},
                                                    scheme)["weight"]
        assert torch.equal(back, ours.float() * scale), weight
        assert torch.all((back - floats[weight]).abs() <= scale / 2 + 1e-7), weight


def test_vllm_picks_the_int8_w8a8_scheme(checkpoint):
    import torch
    from compressed_tensors.quantization import QuantizationStrategy
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import \
        CompressedTensorsW8A8Int8

    config = json.loads((checkpoint["path"] / "config.json").read_text())
    qc = config["quantization_config"]
    cls = get_quantization_config(qc["quant_method"])
    ct = cls.from_config(json.loads(json.dumps(qc)))
    linear = torch.nn.Linear(2, 2)  # matched by class name, as vLLM's *Linear layers
    for i in range(SIZES["num_hidden_layers"]):
        for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                       "mlp.down_proj"):
            scheme = ct.get_scheme(linear, f"model.layers.{i}.{module}")
            assert isinstance(scheme, CompressedTensorsW8A8Int8), (module, scheme)
            assert scheme.strategy == QuantizationStrategy.CHANNEL
            assert not scheme.is_static_input_scheme and scheme.input_symmetric
    assert ct.get_scheme(linear, "lm_head") is None  # ignored: the head stays bf16
