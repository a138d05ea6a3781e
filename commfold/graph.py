"""Small FX helpers shared by patterns and passes: fake values, sizes, source lines,
node insertion with metadata, and whole-graph snapshot/restore."""
from __future__ import annotations

import re
from contextlib import nullcontext

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


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def source_location(node: fx.Node) -> str:
    """`file:line (function)` of the user code that produced node, from its stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return f"<graph node {node.name}>"
    path, line, fn = frames[-1]
    short = "/".join(path.split("/")[-2:])
    return f"{short}:{line} ({fn})"


def fake_mode_of(graph: fx.Graph):
    """The FakeTensorMode of graph's values (looked up once per graph: insert_call
    runs once per new node)."""
    from torch._guards import detect_fake_mode

    cached = getattr(graph, "_commfold_fake_mode", None)
    if cached is not None:
        return cached
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            mode = detect_fake_mode([v])
            if mode is not None:
                graph._commfold_fake_mode = mode
                return mode
    return detect_fake_mode()


def insert_call(graph: fx.Graph, target, args=(), kwargs=None, like: fx.Node | None = None):
    """Create call_function(target) at the graph's current insert point with meta['val']
    computed by running target on the fake inputs (so later passes and Inductor see
    shapes), and the stack trace of `like` (so reports and dumps keep user lines)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, tuple(args), kwargs)
    fake_args = fx.node.map_arg(args, lambda n: n.meta.get("val"))
    fake_kwargs = fx.node.map_arg(kwargs, lambda n: n.meta.get("val"))
    mode = fake_mode_of(graph)
    with mode if mode is not None else nullcontext():
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def snapshot(graph: fx.Graph) -> fx.Graph:
    """A copy of graph's nodes (meta shallow-copied) that restore() can put back."""
    copy = fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def restore(graph: fx.Graph, saved: fx.Graph) -> None:
    """Make graph hold exactly saved's nodes again (after a failed rewrite)."""
    for node in reversed(list(graph.nodes)):
        node.users.clear()
        graph.erase_node(node)
    env: dict = {}
    out = graph.graph_copy(saved, env)
    old_out = next(n for n in saved.nodes if n.op == "output")
    new_out = graph.output(out)
    new_out.meta = dict(old_out.meta)


def erase_if_dead(node: fx.Node, also=()) -> None:
    """Erase node if nothing uses it, then its inputs that became unused, transitively.
    Placeholders and nodes with side effects are kept, except those in `also` (e.g. a
    collective's wait_tensor, which FX counts as side-effecting, when the collective
    itself is being removed)."""
    also = set(also)
    stack = [node]
    while stack:
        n = stack.pop()
        if getattr(n, "_erased", False) or n.op != "call_function" or n.users:
            continue
        if n.is_impure() and n not in also:
            continue
        inputs = [i for i in n.all_input_nodes]
        n.graph.erase_node(n)
        stack.extend(inputs)
