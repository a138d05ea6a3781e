"""Small FX helpers shared by patterns and passes: fake values, sizes, source lines,
node insertion with metadata, and whole-graph snapshot/restore."""
from __future__ import annotations

import re
from contextlib import nullcontext

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized


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
    """`file:line (function)` of the user code that produced node, from its stack trace,
    and ` in <module path>` when the node came from inside an nn.Module (a shared
    helper's line - vLLM's RMSNorm op, say - then still says which layer it was)."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return f"<graph node {node.name}>"
    path, line, fn = frames[-1]
    short = "/".join(path.split("/")[-2:])
    module = module_path(node)
    return f"{short}:{line} ({fn})" + (f" in {module}" if module else "")


def module_path(node: fx.Node) -> str:
    """The innermost module the node was traced in (`model.layers.0.mlp`), or ''."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    fqn = str(list(stack.values())[-1][0])
    fqn = re.sub(r"^L\['self'\]\.?|^self\.?", "", fqn)
    return re.sub(r"\._modules\['([^']+)'\]|\['([^']+)'\]", lambda m: "." + (m[1] or m[2]), fqn)


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


def replay(graph: fx.Graph, x: fx.Node, ops, memo: dict | None = None) -> fx.Node:
    """Re-run a chain of unary-in-x ops (each reads the previous one; other args are
    constants) on x instead, at the insert point: a vocab pass replays the
    elementwise ops between a gather and its reader on the shard. `memo` shares
    replayed prefixes between chains that start alike."""
    memo = {} if memo is None else memo
    for op in ops:
        if op not in memo:
            args = tuple(x if isinstance(a, fx.Node) else a for a in op.args)
            memo[op] = insert_call(graph, op.target, args, dict(op.kwargs), like=op)
        x = memo[op]
    return x


def insert_call(graph: fx.Graph, target, args=(), kwargs=None, like: fx.Node | None = None):
    """Create call_function(target) at the graph's current insert point with meta['val']
    computed by running target on the fake inputs (so later passes and Inductor see
    shapes), and the stack trace of `like` (so reports and dumps keep user lines)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, tuple(args), kwargs)
    fake_args = fx.node.map_arg(args, lambda n: n.meta.get("val"))
    fake_kwargs = fx.node.map_arg(kwargs, lambda n: n.meta.get("val"))
    mode = fake_mode_of(graph)
    kernel = _fake_kernel(target, args) if mode is not None else None
    value = _fake_via_meta(mode, target, kernel, fake_args, fake_kwargs) if kernel is not None else None
    if value is not None:
        node.meta["val"] = value
    elif kernel is not None:  # what FakeTensorMode would run, minus dispatch and its cache
        from torch._library.fake_impl import FakeImplCtx, set_ctx_getter

        ctx = FakeImplCtx(mode, target)
        with set_ctx_getter(lambda: ctx), mode:
            node.meta["val"] = kernel(*fake_args, **fake_kwargs)
    else:
        with mode if mode is not None else nullcontext():
            node.meta["val"] = target(*fake_args, **fake_kwargs)
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


_FAKE_KERNELS: dict = {}


def _fake_kernel(target, args=()):
    """The Python fake kernel of one of commfold's own ops (torch.library
    register_fake), or of auto_functionalized(commfold op) built from it (fake
    dispatch through the higher-order op costs ~1 ms); None otherwise (aten ops,
    Python callables, other libraries' ops)."""
    if target is auto_functionalized and args:
        key = (target, args[0])
        if key not in _FAKE_KERNELS:
            kernel = _fake_kernel(args[0])
            _FAKE_KERNELS[key] = kernel and _functionalized_kernel(args[0], kernel)
        return _FAKE_KERNELS[key]
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "commfold":
        return None
    if target not in _FAKE_KERNELS:
        from torch._library.simple_registry import singleton

        try:
            _FAKE_KERNELS[target] = singleton.find(target.name()).fake_impl.kernel
        except Exception:
            _FAKE_KERNELS[target] = None
    return _FAKE_KERNELS[target]


def _functionalized_kernel(op, kernel):
    """auto_functionalized(op, **kwargs)'s value: op's outputs, then a fresh tensor like
    each argument op writes (as the higher-order op clones them, strides kept)."""
    written = [a.name for a in op._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]

    def run(_op, **kwargs):
        out = kernel(**kwargs)
        return (*(out if isinstance(out, tuple) else (out,)),
                *(torch.empty_strided(kwargs[n].shape, kwargs[n].stride(),
                                      dtype=kwargs[n].dtype, device=kwargs[n].device)
                  for n in written))
    return run


def _static(t: torch.Tensor) -> bool:
    return all(type(s) is int for s in t.shape) and all(type(s) is int for s in t.stride())


def _fake_via_meta(mode, target, kernel, args, kwargs):
    """kernel's outputs for static-shaped fake inputs, computed on meta stand-ins and
    wrapped as fakes on the inputs' device, as FakeTensorMode wraps a meta kernel's
    outputs; the output metadata is remembered per (op, input metadata, other
    arguments): a fake kernel sees nothing else, and a model repeats the same call
    per layer. Several times cheaper than fake dispatch (insert_call's main cost per
    rewrite). None when it does not apply (symbolic shapes, several devices, a kernel
    that needs the fake context or makes non-meta tensors): the caller falls back to
    fake dispatch."""
    device = None

    def to_meta(a):
        nonlocal device
        if not isinstance(a, torch.Tensor):
            return a
        if not _static(a) or (device is not None and a.device != device):
            raise _NotStatic
        device = a.device
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")

    try:
        key = (target, _frozen(args), _frozen(kwargs))
        hash(key)
    except (TypeError, _NotStatic):
        key = None
    outs = _META_OUTPUTS.get(key) if key is not None else None
    if outs is None:
        try:
            margs = fx.node.map_aggregate(args, to_meta)
            mkwargs = fx.node.map_aggregate(kwargs, to_meta)
            if device is None:
                return None
            out = kernel(*margs, **mkwargs)
        except Exception:
            return None
        single = not isinstance(out, tuple)
        out = (out,) if single else out
        if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in out):
            return None
        outs = (single, device, tuple((tuple(t.shape), t.stride(), t.dtype) for t in out))
        if key is not None:
            if len(_META_OUTPUTS) > 4096:
                _META_OUTPUTS.clear()
            _META_OUTPUTS[key] = outs
    single, device, metas = outs
    conv = mode.fake_tensor_converter
    fakes = tuple(conv.from_meta_and_device(
        mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device)
        for shape, stride, dtype in metas)
    return fakes[0] if single else fakes


_META_OUTPUTS: dict = {}


def _frozen(x):
    """A hashable form of an argument structure: tensors by their metadata."""
    if isinstance(x, torch.Tensor):
        if not _static(x):
            raise _NotStatic
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *map(_frozen, x))
    if isinstance(x, dict):
        return ("dict", *((k, _frozen(v)) for k, v in x.items()))
    return (type(x).__name__, x)


class _NotStatic(Exception):
    pass


def snapshot(graph: fx.Graph) -> fx.Graph:
    """A copy of graph's nodes (meta shallow-copied) that restore() can put back; an
    independent fx.Graph (for observers). Checkpoint is the cheap form for restore."""
    copy = fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


class Checkpoint:
    """A graph's nodes as they are now, cheaply: each node's identity, op, target,
    args, kwargs, name and a shallow copy of its meta (FX replaces args/kwargs on
    update, never mutates them in place, so holding them is holding a copy). A few
    microseconds per node, against ~50 for snapshot()'s node copies; restore()
    rebuilds the nodes from it (rare: only after a pass failed)."""

    __slots__ = ("rows",)

    def __init__(self, graph: fx.Graph):
        self.rows = [(n, n.op, n.target, n.args, n.kwargs, n.name, n.type, dict(n.meta))
                     for n in graph.nodes]


def restore(graph: fx.Graph, saved) -> None:
    """Make graph hold exactly saved's nodes again (after a failed rewrite); saved is a
    Checkpoint or a snapshot() graph."""
    nodes = list(graph.nodes)
    for node in nodes:  # unlink first: a malformed graph may read a node defined later
        node.args, node.kwargs = (), {}
    for node in reversed(nodes):
        graph.erase_node(node)
    if isinstance(saved, Checkpoint):
        env: dict = {}
        for old, op, target, args, kwargs, name, type_expr, meta in saved.rows:
            new = graph.create_node(op, target, fx.node.map_arg(args, env.__getitem__),
                                    fx.node.map_arg(kwargs, env.__getitem__), name, type_expr)
            new.meta = dict(meta)
            env[old] = new
        return
    env = {}
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
