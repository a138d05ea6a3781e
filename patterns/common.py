"""The op vocabulary recognizers share: aten/prims/c10d handles, other libraries' ops
looked up by name (only when registered: commfold never imports vLLM), the argument
decoding of auto_functionalized(_v2), the Miss result, and walkers over spellings
several recognizers read (a collective's waits, a slice to the valid vocab, a
reader a few ops downstream). Vocabulary-free node accessors live in commfold.fx.nodes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, TypeVar, final

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import (auto_functionalized,
                                                        auto_functionalized_v2)

from commfold.fx.nodes import arg, is_call, norm_dim, only_user, val

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
AUTO_FUNCTIONALIZED = (auto_functionalized, auto_functionalized_v2)


@final
@dataclass(frozen=True)
class Miss:
    """A recognizer's answer when a shape almost matched: why it did not."""

    reason: str
    node: fx.Node | None = None

    def __bool__(self) -> Literal[False]:  # a Miss is never a match: `if not m` narrows
        return False


M = TypeVar("M")
# What a recognizer answers: its match, a Miss (the shape almost matched: why not), or
# None (nothing like the shape). Only a match is truthy, so `if not m: return m` hands
# both non-matches on, and a caller that tests `m is None` alone still holds a Miss
# where the checker wants the match's fields.
Recognized: TypeAlias = M | Miss | None
Verdict: TypeAlias = M | Miss  # a recognizer that always decides: the match or why not


def optional_op(namespace: str, name: str, overload: str = "default"):
    """torch.ops.<namespace>.<name>.<overload>, or None while no library registered it
    (vLLM's ops exist only once vLLM, or its kernels, were imported)."""
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return None


def is_functionalized(node, op) -> bool:
    """node is auto_functionalized(_v2)(op, ...): a mutating op, functionalized."""
    return (op is not None and is_call(node, *AUTO_FUNCTIONALIZED) and bool(node.args)
            and node.args[0] is op)


_VIEWED_AS = ("size", "stride", "storage_offset", "slice_dim", "slice_start", "slice_end")


def functional_kwargs(af: fx.Node) -> dict | None:
    """The op's own kwargs of an auto_functionalized(_v2) node. v1 passes them as
    they are; v2 passes a mutated argument as a base (`_all_bases[_<name>_base_index]`)
    plus how it is viewed: an alias of the base is the base, any other view gives
    None (what the op then mutates is not a whole tensor)."""
    kw: dict[str, Any] = dict(af.kwargs)  # the op's arguments: any kind
    bases = kw.pop("_all_bases", None)
    if bases is None:
        return kw
    out = {}
    for k, v in kw.items():
        if k.startswith("_") and k.endswith("_base_index"):
            name = k[1:-len("_base_index")]
            if any(f"_{name}_{view}" in kw for view in _VIEWED_AS):
                return None
            out[name] = bases[v] if v is not None else None
        elif not k.startswith("_"):
            out[k] = v
    return out


def waits_of(node: fx.Node) -> list[fx.Node]:
    """The chain of wait_tensor nodes after a collective (a user's explicit wait adds a
    second one); empty if none."""
    chain: list[fx.Node] = []
    while True:
        nxt = only_user(node)
        if nxt is None or not is_call(nxt, c10d.wait_tensor.default):
            return chain
        chain.append(nxt)
        node = nxt


def vocab_slice_end(node: fx.Node, rank: int) -> Verdict[tuple[int | fx.Node | None]]:
    """(end,) when slice node keeps the vocab dim's [0:end] (end an int, a SymInt
    node, or None), else a Miss saying why. The ops given `end` apply slice's own
    clamping at run time (end may be symbolic)."""
    dim, start, end, step = (arg(node, k) for k in ("dim", "start", "end", "step"))
    if norm_dim(dim, rank) != rank - 1:
        return Miss("slice on a dim other than vocab", node)
    if start not in (0, None) or step != 1 or not _int_like(end):
        return Miss("slice of the vocab dim other than [0:V]", node)
    if isinstance(end, int) and end <= 0:
        return Miss("slice of the vocab dim with a non-positive end", node)
    return (end,)


def _int_like(x) -> bool:
    """None, an int, or a node computing a SymInt (a symbolic vocab size)."""
    if x is None or (isinstance(x, int) and not isinstance(x, bool)):
        return True
    return isinstance(x, fx.Node) and isinstance(val(x), torch.SymInt)


def reader_within(node: fx.Node, is_reader, hops: int = 6) -> fx.Node | None:
    """The first node at most `hops` - 1 ops downstream of node (node itself
    included, any path) for which is_reader(n) holds, else None: a shape a
    recognizer could not follow is a near-miss only when what it looks for is close."""
    frontier, seen = [node], set()
    for _ in range(hops):
        nxt: list[fx.Node] = []
        for n in frontier:
            if is_reader(n):
                return n
            if n not in seen:
                seen.add(n)
                nxt.extend(n.users)
        frontier = nxt
    return None


def op_name(node: fx.Node) -> str:
    """A call's op name as reasons print it ('argmax', 'getitem'), else the node kind."""
    if node.op != "call_function":
        return node.op
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]
