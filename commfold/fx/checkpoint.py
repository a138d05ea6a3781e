"""Putting a graph back as it was: the pass manager checkpoints a graph before the
passes and restores it when one fails; `commfold diff` snapshots it around each pass."""
from __future__ import annotations

import torch.fx as fx


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
