"""The RMSNorm match every RMSNorm recognizer returns (patterns.rmsnorm: aten
spellings; patterns.rmsnorm_vllm: vLLM's IR ops): a leaf module, so the two
recognizers import it and not each other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch
import torch.fx as fx

from commfold.fx.nodes import fake_tensor


@final
@dataclass(frozen=True)
class RMSNorm:
    x: fx.Node  # the value normed (before the residual add)
    residual: fx.Node | None
    h: fx.Node | None  # x + residual (or x): the new residual; None when not computed
    weight: fx.Node | None  # the raw weight ([hidden]); offset applied by the kernel
    eps: float
    offset: float  # Gemma: out * (offset + w)
    offset_in_weight_dtype: bool  # the offset sum is rounded to the weight's dtype
    round_before_weight: bool  # n is cast to h's dtype before the weight multiply
    out_dtype: torch.dtype
    output: fx.Node  # the normed value
    inner: tuple[fx.Node, ...]  # nodes between h and output, read only by the norm
    sum_in_f32: bool = False  # the norm reads the exact f32 sum, h is rounded apart
    eager: bool = False  # an eager op: every cast rounds (not fused by Inductor)
    # a view of x adding or removing leading 1s that the residual add reads instead
    # of x (patterns.broadcast); a fusion needs it read by the add alone
    x_view: fx.Node | None = None

    @property
    def dtype(self) -> torch.dtype:
        return fake_tensor(self.x).dtype
