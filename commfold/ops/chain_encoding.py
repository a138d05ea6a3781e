"""Elementwise chains the local selection ops evaluate themselves: the positive scale,
temperature, offset and tanh soft-cap a graph applies to the logits before its pick,
so the op reads the raw shard once instead of a materialized scaled copy.

A chain is a flat list of floats, (code, constant) pairs, in order:

    MUL c, DIV c, ADD c, SUB c   x * c, x / c, x + c, x - c (c a Python number)
    TANH                         tanh(x)
    CAST d                       the value's dtype becomes d (F32, BF16, F16); only
                                 widening or same-width casts (no value changes)

Values are computed in float32 as Inductor's CPU code computes the chain (constants
cast to float32, true division, no rounding between ops), and compared unrounded by
argmax and the softmax statistics (as Inductor's fused reduction compares them) and
rounded to the chain's output dtype by top-k (whose input Inductor materializes).
Values returned are rounded to the output dtype. The C++ kernels compute tanh with
ATen's vectorized tanh (Sleef), as Inductor does; this torch fallback uses torch.tanh,
which may differ from it in the last bit on CPU (it runs on CUDA, or when forced).
"""
from __future__ import annotations

import torch

MUL, DIV, ADD, SUB, TANH, CAST = 1, 2, 3, 4, 5, 6
F32, BF16, F16 = 0, 1, 2  # CAST's dtype codes
DTYPE_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
MAX_OPS = 16
_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2}
_NAMES = {"mul": MUL, "div": DIV, "add": ADD, "sub": SUB, "tanh": TANH}


def encode(steps, dtype: torch.dtype) -> list[float] | None:
    """The chain for `steps` - (name, constant) pairs: ("mul" | "div" | "add" | "sub",
    number), ("tanh", None), ("cast", torch dtype) - applied to a `dtype` shard; None
    when it cannot be evaluated exactly this way (a narrowing or float64 cast, another
    op, a non-finite or non-number constant, too many ops)."""
    if dtype not in DTYPE_CODES:
        return None
    out, codes = dtype, []
    for name, const in steps:
        if name == "cast":
            if const not in DTYPE_CODES or _WIDTH[const] < _WIDTH[out] or (
                    _WIDTH[const] == _WIDTH[out] and const != out):
                return None
            out = const
            codes += [CAST, float(DTYPE_CODES[const])]
        elif name == "tanh":
            codes += [TANH, 0.0]
        elif name in _NAMES:
            if isinstance(const, bool) or not isinstance(const, (int, float)) \
                    or not abs(float(const)) < float("inf"):
                return None
            codes += [_NAMES[name], float(const)]
        else:
            return None
    if len(codes) // 2 > MAX_OPS:
        return None
    return codes or None


def out_dtype(chain, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the chain's values (its last cast; else the shard's)."""
    out = dtype
    for i in range(0, len(chain or ()), 2):
        if chain[i] == CAST:
            out = CODE_DTYPES[int(chain[i + 1])]
    return out


def apply(x: torch.Tensor, chain) -> torch.Tensor:
    """The chain's values of x in float32, unrounded (the torch fallback)."""
    v = x.float()
    for i in range(0, len(chain), 2):
        code, c = int(chain[i]), torch.tensor(chain[i + 1], dtype=torch.float32,
                                              device=x.device)
        if code == MUL:
            v = v * c
        elif code == DIV:
            v = v / c
        elif code == ADD:
            v = v + c
        elif code == SUB:
            v = v - c
        elif code == TANH:
            v = torch.tanh(v)
        elif code != CAST:
            raise ValueError(f"commfold: unknown chain op {code}")
    return v


def stored(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 chain values as the graph stores them in `dtype` (round to nearest
    even; every NaN one quiet NaN, as the C++ kernels write it)."""
    nan = torch.tensor(float("nan"), dtype=torch.float32, device=v.device)
    return torch.where(v.isnan(), nan, v).to(dtype)


def for_shard(shard, steps) -> list[float] | None:
    """The chain a graph pass hands the op for `steps` (patterns.scan_chain) on a
    shard with fake value `shard`, or None: replay the steps as graph ops instead.
    Only CPU shards get one - the C++ kernels compute it as Inductor's CPU code
    does; on other devices the graph's own kernels keep computing it, as the
    unrewritten program's did."""
    if not steps or shard is None or shard.device.type != "cpu":
        return None
    return encode(steps, shard.dtype)
