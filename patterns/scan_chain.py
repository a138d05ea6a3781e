"""Elementwise ops between a gathered row and its reader, spelled as the steps a local
selection op can evaluate itself (commfold.ops.chain_encoding encodes them): multiply,
divide, add or subtract a Python number, tanh, float casts, clones. The caller
replays anything else on the shard as graph ops."""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from .common import aten, is_call, prims

_ARITH: dict[Any, str] = {aten.mul.Tensor: "mul", aten.div.Tensor: "div", aten.add.Tensor: "add",
          aten.sub.Tensor: "sub"}
_COMMUTE = ("mul", "add")


def chain_steps(nodes) -> list[tuple[str, Any]] | None:
    """[(name, constant)] for the chain of single-input elementwise nodes (each reads
    the one before), or None when one of them is not such a step."""
    steps: list[tuple[str, Any]] = []  # (name, its constant: a number, a dtype, None)
    prev = None
    for node in nodes:
        x = node.args[0] if node.args else None
        if is_call(node, aten.clone.default):
            pass
        elif is_call(node, aten.tanh.default):
            steps.append(("tanh", None))
        elif is_call(node, prims.convert_element_type.default):
            steps.append(("cast", node.args[1]))
        elif is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"} \
                and "dtype" in node.kwargs:
            steps.append(("cast", node.kwargs["dtype"]))
        elif is_call(node, *_ARITH) and len(node.args) == 2 and not node.kwargs:
            name = _ARITH[node.target]
            a, b = node.args
            if isinstance(b, fx.Node) and name in _COMMUTE and not isinstance(a, fx.Node):
                a, b = b, a
            if not isinstance(a, fx.Node) or isinstance(b, fx.Node):
                return None
            x = a
            steps.append((name, b))
        else:
            return None
        if prev is not None and x is not prev:
            return None
        prev = node
    return steps
