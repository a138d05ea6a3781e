"""The near-miss rule of the all-reduce + RMSNorm fusion: a reduced value that an
RMSNorm reads within a few elementwise ops, but that no recognizer matched, is a
near-miss naming the op on the way that no spelling takes (a tanh, a second scale, a
view, a broadcast add, ...): an untaken site is never silent.

"On the way" is the shortest path of elementwise ops (ops tagged pointwise, casts,
views, getitem) from the value to where a norm starts: the square that mean.dim
reads (pow(., 2) or x * x), one of vLLM's IR norms, or commfold's fused norm (the
value reaches it as a residual). The spellings take, in this order: one scale by a
number or a 0-d tensor of the value's dtype (patterns.residual_scale), one residual
add of a tensor of the same dtype and shape (or one differing by leading size-1
dims, read through a view adding or removing them: patterns.broadcast), casts
to f32 anywhere. The first op
that breaks this order is named with the property that failed (an add of another
dtype, an add that would repeat an operand's elements - a true broadcast - and whose,
a view that is not a leading-1 view, a second scale or add, a scale by a tensor);
when the path fits it and still nothing matched, the norm's first op is.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from commfold.fx.nodes import dtype_of, is_call

from .broadcast import leading_ones_only, leading_view, repeated, shape_text
from .common import AUTO_FUNCTIONALIZED, Miss, aten, is_functionalized, op_name, optional_op, prims
from .residual_scale import scale_of

HOPS = 4  # ops between the value and the norm's first op, at most
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default,
          aten.permute.default, aten.slice.Tensor, aten.select.int, aten._to_copy.default,
          aten.alias.default)
_CASTS = (aten._to_copy.default,)


def unmatched_norm(value: fx.Node, hops: int = HOPS) -> Miss | None:
    """A Miss naming what stops the fusion when an RMSNorm is within `hops`
    elementwise ops of value (call it when no recognizer matched), and the property
    of that op that failed (shape, dtype, order); else None."""
    path = norm_path(value, hops)
    if path is None:
        return None
    stop = _first_off_spelling(path)
    if stop is not None:
        node, prev, why = stop
        return Miss(why or f"{op_label(node)} between all_reduce and rmsnorm: "
                    "not a residual add, one scale by a constant or a float32 upcast", node)
    return Miss(f"rmsnorm starting at {op_label(path[-1])} matched no spelling", path[-1])


def norm_path(value: fx.Node, hops: int = HOPS) -> list[fx.Node] | None:
    """[value, ..., the norm's first op]: the shortest path through elementwise ops
    with at most `hops` of them between the two ends; None when there is none."""
    parent: dict[fx.Node, fx.Node | None] = {value: None}
    frontier = [value]
    for _ in range(hops + 1):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in parent:
                    continue
                parent[u] = n
                if norm_start(u):
                    path = [u]
                    while (before := parent[path[-1]]) is not None:
                        path.append(before)
                    return path[::-1]
                if _elementwise(u):
                    nxt.append(u)
        frontier = nxt
    return None


def norm_start(node: fx.Node) -> bool:
    """node is where an RMSNorm begins: the square mean.dim reads, or a norm op."""
    if is_call(node, aten.pow.Tensor_Scalar) and node.args[1] == 2 or \
            is_call(node, aten.mul.Tensor) and node.args[0] is node.args[1]:
        return any(is_call(u, aten.mean.dim) for u in node.users)
    rms = optional_op("vllm_ir", "rms_norm")
    if rms is not None and is_call(node, rms):
        return True
    return any(is_functionalized(node, op) for op in (
        optional_op("vllm_ir", "fused_add_rms_norm", "maybe_inplace"),
        optional_op("commfold", "allreduce_rmsnorm"),
        optional_op("commfold", "allreduce_rmsnorm", "scaled")))


def op_label(node: fx.Node) -> str:
    """The op as reasons name it: 'aten.tanh.default', a functionalized op's own name."""
    if is_call(node, *AUTO_FUNCTIONALIZED) and node.args:
        return str(node.args[0])
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)
    return op_name(node)


def _elementwise(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem or t in _VIEWS:
        return True
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags


def _first_off_spelling(path: list[fx.Node]) -> tuple[fx.Node, fx.Node, str | None] | None:
    """The first op between the ends of path that the spellings do not take there,
    the value on the path it reads, and why (None: no more specific reason)."""
    scale_ok, add_ok = True, True
    prev = path[0]
    for i, n in enumerate(path[1:-1], 1):
        if scale_ok and scale_of(n, prev) is not None:
            scale_ok = False
        elif add_ok and _residual_add(n, prev):
            scale_ok = add_ok = False
        elif add_ok and leading_view(n, prev) and _residual_add(path[i + 1], n):
            scale_ok = False  # out.unsqueeze(0) + residual: the add is next
        elif _upcast(n):
            scale_ok = False
        else:
            return n, prev, _why(n, prev, add_ok)
        prev = n
    return None


def _why(node: fx.Node, x: fx.Node, add_ok: bool) -> str | None:
    """What of node, reading the value x on the way to the norm, no spelling takes."""
    label = op_label(node)
    if is_call(node, aten.add.Tensor) and add_ok:
        other = _operand(node, x)
        if other is not None and dtype_of(other) != dtype_of(x):
            return (f"{label} adds the all-reduce's {dtype_of(x)} {shape_text(x)} to a "
                    f"{dtype_of(other)} operand: dtypes differ (the fused op adds in the "
                    "all-reduce's dtype)")
        if other is not None:
            who = repeated(x, other, node)
            if who is not None:
                return (f"{label} broadcasts the all-reduce's {shape_text(x)} against "
                        f"{shape_text(other)}: {who} elements would be repeated")
    if node.target in _VIEWS and node.target not in _CASTS:
        return (f"{label} views the all-reduce's {shape_text(x)} as {shape_text(node)}: "
                "not only leading size-1 dims added or removed before a residual add")
    if scale_of(node, x) is not None:
        return (f"{label} scales the all-reduce's value a second time (one scale is fused)"
                if add_ok else f"{label} scales the sum after the residual add (a scale is "
                "fused only before the add)")
    other = _operand(node, x)
    if is_call(node, aten.mul.Tensor, aten.div.Tensor) and other is not None:
        verb = "multiplies" if is_call(node, aten.mul.Tensor) else "divides"
        return (f"{label} {verb} the all-reduce's {dtype_of(x)} {shape_text(x)} by a "
                f"{dtype_of(other)} {shape_text(other)} tensor: a scale is a number or a 0-d "
                "tensor of the value's dtype")
    if is_call(node, aten.add.Tensor) and not add_ok:
        return f"{label} is a second add after the residual add (one add is fused)"
    return None


def _operand(node: fx.Node, x: fx.Node) -> fx.Node | None:
    """The other tensor operand of a binary node reading x once."""
    if len(node.args) != 2:
        return None
    a, b = node.args
    other = b if a is x else a if b is x else None
    return other if isinstance(other, fx.Node) and other is not x else None


def _residual_add(node: fx.Node, x: fx.Node) -> bool:
    other = _other(node, x)
    return other is not None and leading_ones_only(other, x)


def _other(node: fx.Node, x: fx.Node) -> fx.Node | None:
    """The other operand of an add of x and a tensor of x's dtype (the add's too)."""
    if not is_call(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    other = b if a is x else a if b is x else None
    if not isinstance(other, fx.Node) or other is x:
        return None
    return other if dtype_of(other) == dtype_of(x) == dtype_of(node) else None


def _upcast(node: fx.Node) -> bool:
    # a dtype argument is a torch.dtype: the isinstance keeps `==` a plain bool where an
    # FX argument could be a SymInt (torch 2.14's stubs type its `==` as SymBool)
    if is_call(node, prims.convert_element_type.default):
        to = node.args[1]
    elif is_call(node, aten._to_copy.default):
        to = node.kwargs.get("dtype")
    else:
        return False
    return isinstance(to, torch.dtype) and to == torch.float32
