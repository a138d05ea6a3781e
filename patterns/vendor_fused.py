"""All-reduce + RMSNorm sites another library already fused into the graph before
commfold's pass ran: vLLM's own fusion pass (on by default from vLLM 0.33 at -O2 on
SM90/SM100 GPUs, TP > 1, FlashInfer) writes ``vllm.flashinfer_trtllm_fused_allreduce_norm``
(ROCm: AITER's ``rocm_aiter_fused_allreduce_rmsnorm``, with or without a quantized
output). Such a site has no all-reduce left for commfold to match - it is never fused
twice - and the report lists it as already fused instead of staying silent. Matched by
the op's schema name, so nothing here needs vLLM (or FlashInfer) to be importable."""
from __future__ import annotations

from dataclasses import dataclass
from typing import final

from torch import fx

from .common import AUTO_FUNCTIONALIZED, is_call

# schema name -> who fused it
VENDOR_FUSED = {
    "vllm::flashinfer_trtllm_fused_allreduce_norm": "vLLM (FlashInfer TRT-LLM all-reduce + norm)",
    "vllm::rocm_aiter_fused_allreduce_rmsnorm": "vLLM (ROCm AITER all-reduce + RMSNorm)",
    "vllm::rocm_aiter_fused_allreduce_rmsnorm_quant_per_group":
        "vLLM (ROCm AITER all-reduce + RMSNorm + quant)",
    "vllm::rocm_aiter_fused_allreduce_rmsnorm_quant_per_group_with_bf16_norm":
        "vLLM (ROCm AITER all-reduce + RMSNorm + quant)",
}


@final
@dataclass(frozen=True)
class VendorFusion:
    node: fx.Node  # the fused op's call (its auto_functionalized node, when mutating)
    op: str  # its schema name
    by: str  # who fused it


def match_vendor_fusion(node: fx.Node) -> VendorFusion | None:
    """The fused all-reduce + norm op another library wrote at `node`, or None."""
    if node.op != "call_function":
        return None
    target = node.args[0] if is_call(node, *AUTO_FUNCTIONALIZED) and node.args else node.target
    schema = getattr(target, "_schema", None)
    name = getattr(schema, "name", None)
    if name in VENDOR_FUSED:
        return VendorFusion(node, name, VENDOR_FUSED[name])
    return None
