"""Full vocab-padded logits for the vocab-gather tests (local_argmax, local_topk,
local_softmax_stats): every rank builds the same [rows, world*Vs] tensor from a case
and keeps its shard. Edge kinds: ties, NaN, +-inf, all -inf rows, ties across the
shard boundary, signed zeros; padding columns hold +inf / NaN bait, so a reader that
looks at them is wrong."""
from __future__ import annotations

import math

import torch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def make_logits(case: dict, world: int) -> tuple[torch.Tensor, int]:
    """(full padded logits in case["dtype"], the valid vocab)."""
    rows, vocab, kind = case["rows"], case["vocab"], case["special"]
    vs = -(-vocab // world)
    g = torch.Generator().manual_seed(case["seed"])
    x = with_special(torch.randn(rows, world * vs, generator=g, dtype=torch.float64) * 4,
                     kind, g)
    if kind == "neginf_row":
        x[:] = -math.inf
    elif kind == "boundary_tie" and world > 1:
        x[:, max(vs - 2, 0):vs + 2] = 100.0  # rank 0's last columns tie rank 1's first
    x = x.to(case["dtype"])
    if world * vs > vocab:
        bait_nan = kind == "padding_bait" or case["seed"] % 2
        x[:, vocab:] = math.nan if bait_nan else math.inf
    return x, vocab


def with_special(x: torch.Tensor, kind: str, g: torch.Generator) -> torch.Tensor:
    """float64 logits x with the edge kinds every vocab test uses - integer ties, 5%
    NaN, 5% +inf and 5% -inf, signed zeros (-0.0 == +0.0: ties whose bits differ) -;
    any other kind: x as it is."""
    if kind == "ties":
        return torch.randint(-2, 3, x.shape, generator=g).double()
    if kind == "nan":
        x[torch.rand(x.shape, generator=g) < 0.05] = math.nan
    elif kind == "inf":
        x[torch.rand(x.shape, generator=g) < 0.05] = math.inf
        x[torch.rand(x.shape, generator=g) < 0.05] = -math.inf
    elif kind == "signed_zero":
        x = torch.randint(-1, 2, x.shape, generator=g).double() * 0.0
        x[:, ::3] = -0.0
    return x
