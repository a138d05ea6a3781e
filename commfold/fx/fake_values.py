"""Fake values of the nodes passes insert: the shapes, dtypes and strides a new
node's outputs will have, so later passes and Inductor see them. commfold's own ops
get theirs from their Python fake kernels on meta stand-ins, remembered per input
metadata (several times cheaper than fake dispatch, insert_call's main cost per
rewrite); every other target runs under the graph's FakeTensorMode."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized


_MODE_ATTR = "_commfold_fake_mode"  # where a graph keeps its FakeTensorMode, once found


def fake_mode_of(graph: fx.Graph):
    """The FakeTensorMode of graph's values (looked up once per graph: insert_call
    runs once per new node)."""
    from torch._guards import detect_fake_mode

    cached = getattr(graph, _MODE_ATTR, None)
    if cached is not None:
        return cached
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            mode = detect_fake_mode([v])
            if mode is not None:
                setattr(graph, _MODE_ATTR, mode)
                return mode
    return detect_fake_mode()


def fake_value(graph: fx.Graph, target, args=(), kwargs=None):
    """What call_function(target, args, kwargs) holds, computed on the fake values of
    its node arguments (their meta['val'])."""
    kwargs = kwargs or {}
    fake_args = fx.node.map_arg(args, lambda n: n.meta.get("val"))
    fake_kwargs = fx.node.map_arg(kwargs, lambda n: n.meta.get("val"))
    mode = fake_mode_of(graph)
    kernel = _fake_kernel(target, args) if mode is not None else None
    if kernel is not None:
        value = _fake_via_meta(mode, target, kernel, fake_args, fake_kwargs)
        if value is not None:
            return value
        # what FakeTensorMode would run, minus dispatch and its cache
        from torch._library.fake_impl import FakeImplCtx, set_ctx_getter

        ctx = FakeImplCtx(mode, target)
        with set_ctx_getter(lambda: ctx), mode:
            return kernel(*fake_args, **fake_kwargs)
    with mode if mode is not None else nullcontext():
        return target(*fake_args, **fake_kwargs)


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
