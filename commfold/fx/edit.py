"""Graph surgery the passes share: insert a call with its fake value and the user's
source line, replay a chain of elementwise ops on another input, rewire a tuple
result's getitems, erase what became dead."""
from __future__ import annotations

import torch.fx as fx

from commfold.fx.fake_values import fake_value


def insert_call(graph: fx.Graph, target, args=(), kwargs=None, like: fx.Node | None = None):
    """Create call_function(target) at the graph's current insert point with meta['val']
    computed by running target on the fake inputs (so later passes and Inductor see
    shapes), and the stack trace of `like` (so reports and dumps keep user lines)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, tuple(args), kwargs)
    node.meta["val"] = fake_value(graph, target, args, kwargs)
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


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


def replace_items(node: fx.Node, outputs) -> None:
    """node returns a tuple read only through getitems (max.dim, topk): make each
    getitem's readers read outputs[i] instead, and erase the getitems."""
    for item in list(node.users):
        item.replace_all_uses_with(outputs[item.args[1]])
        node.graph.erase_node(item)


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
