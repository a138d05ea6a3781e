"""Node accessors: what an FX node holds and how it is called. The one home of these
helpers for patterns/ and passes/ alike; they know no op vocabulary (that is
patterns/common.py's)."""
from __future__ import annotations

import operator
from typing import Any, TypeGuard

import torch
import torch.fx as fx


def val(node) -> object:
    """The fake value recorded on a node (a FakeTensor, SymInt, tuple...) or None; a
    non-node is its own value."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def tensor_val(node) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def fake_tensor(node) -> torch.Tensor:
    """The fake tensor of a node known to hold one (an op's tensor operand, or output,
    in a traced graph, or a node a recognizer checked); a TypeError if it holds none."""
    v = val(node)
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{node} holds no tensor value ({type(v).__name__})")
    return v


def operands(node: fx.Node) -> tuple[Any, ...]:
    """node.args, to unpack once the op is known: what each holds (a node, an int, a
    dtype, a list) is the op schema's to say, which the checker cannot read (its type
    for an FX argument is a union of every kind one may be)."""
    return node.args


def dtype_of(node) -> torch.dtype | None:
    """The dtype of a node holding a tensor, else None."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


def ndim(node) -> int | None:
    v = tensor_val(node)
    return v.dim() if v is not None else None


def shape_of(x) -> list | None:
    """A node's tensor shape, or x itself as a list (a shape given directly)."""
    if isinstance(x, fx.Node):
        v = x.meta.get("val")
        return list(v.shape) if isinstance(v, torch.Tensor) else None
    return list(x)


def same_shape(a, b) -> bool:
    """Shapes (of nodes' fake values, or lists) provably equal, symbolic sizes included."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    sa, sb = shape_of(a), shape_of(b)
    if sa is None or sb is None or len(sa) != len(sb):
        return False
    return all(statically_known_true(x == y) for x, y in zip(sa, sb))


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


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


def lower_bound(x) -> int:
    """The least value an int or SymInt can take (its ShapeEnv range; 0 if unknown)."""
    n = static_int(x)
    if n is not None:
        return n
    try:
        low = x.node.shape_env.bound_sympy(x.node.expr).lower
        return max(0, int(low)) if getattr(low, "is_finite", False) else 0
    except Exception:
        return 0


def min_nbytes(t: torch.Tensor) -> int:
    """The fewest bytes the tensor can hold over every size its symbols may take."""
    n = t.element_size()
    for d in t.shape:
        n *= lower_bound(d)
    return n


def is_number(x) -> TypeGuard[int | float]:
    """A Python int or float (a bool is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def numel(t: torch.Tensor) -> int | str:
    """Static element count, or the symbolic expression as text."""
    n = 1
    for s in t.shape:
        n = n * s
    static = static_int(n)  # never int() a SymInt: that guards, specializing a dynamic size
    return static if static is not None else str(n)


def numel_times(t: torch.Tensor, factor: int) -> int | str:
    """numel(t) * factor (e.g. the bytes of `factor`-byte items per element), as text
    when the count is symbolic."""
    n = numel(t)
    return n * factor if isinstance(n, int) else f"{n}*{factor}"


def nbytes(t: torch.Tensor) -> int | str:
    return numel_times(t, t.element_size())


def is_call(node, *targets) -> TypeGuard[fx.Node]:
    """node is a call of one of targets (the checker then knows it is a Node)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_getitem(node, index=None) -> TypeGuard[fx.Node]:
    return (is_call(node, operator.getitem)
            and (index is None or node.args[1] == index))


def only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


_ARGS: dict = {}  # (op, argument name) -> (position or None if keyword-only, default)


def arg(node: fx.Node, name: str) -> Any:
    """The argument `name` of an op call, passed by position or keyword, else the
    op schema's default (None when it has none): keepdim, dim, slice bounds, ...
    read the same way everywhere, with the op's own defaults."""
    key = (node.target, name)
    spec = _ARGS.get(key)
    if spec is None:
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            raise AttributeError(f"{node.target} has no op schema")
        found = [(None if a.kwarg_only else i, a.default_value if a.has_default_value()
                  else None) for i, a in enumerate(schema.arguments) if a.name == name]
        if not found:
            raise KeyError(f"{node.target} has no argument {name!r}")
        spec = _ARGS[key] = found[0]
    pos, default = spec
    if pos is not None and pos < len(node.args):
        return node.args[pos]
    return node.kwargs.get(name, default)
