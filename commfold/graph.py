"""Node accessors: what an FX node holds (fake values, sizes)."""
from __future__ import annotations

import torch
import torch.fx as fx


def val(node) -> object:
    """The fake value recorded on a node (a FakeTensor, SymInt, tuple...) or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def tensor_val(node) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def numel(t: torch.Tensor) -> int | str:
    """Static element count, or the symbolic expression as text."""
    n = 1
    for s in t.shape:
        n = n * s
    static = static_int(n)  # never int() a SymInt: that guards, specializing a dynamic size
    return static if static is not None else str(n)


def nbytes(t: torch.Tensor) -> int | str:
    n = numel(t)
    return n * t.element_size() if isinstance(n, int) else f"{n}*{t.element_size()}"


def static_int(x) -> int | None:
    """x as a plain int when it is one (or a SymInt with a constant value), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        try:
            node = x.node
            if node.is_constant() if hasattr(node, "is_constant") else False:
                return int(x)
            expr = node.expr
            if getattr(expr, "is_number", False):
                return int(expr)
        except Exception:
            return None
    return None
