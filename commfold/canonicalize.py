"""Canonicalization: the step the manager runs on a graph before any pass, so the
recognizers see one spelling of each value and passes only rewrite what they match.

Each step keeps every value the graph computes, bit for bit (it only drops nodes
nobody reads and points readers at the very tensor they read back), and depends on
the graph alone: every rank canonicalizes the same. ``canonicalize`` returns what it
changed, by step; the manager records that in the report (``Report.canonicalized``).

Steps, in order:
- dead shape queries: torch 2.11-2.12 leave unread ``sym_size`` / ``sym_stride`` /
  ``sym_numel`` / ``sym_storage_offset`` nodes in post-grad graphs (of a DTensor's
  gathered logits, say), where they would count as one more reader of a value a pass
  replaces; Inductor drops them anyway.
- slice read-backs: ``x[:, :V] *= c`` (vLLM's LogitsProcessor scales its gathered
  logits so), functionalized, reads the scattered values back through a slice of the
  slice_scatter (patterns.slice_writeback recognizes it); left so, the gathered row
  has two readers and hides every pick behind it. Each read-back is pointed at the
  scattered values themselves, and the scatter dropped when nothing else reads it.

A new step: a function (graph) -> number of changes, added to STEPS under a name
that says what it changed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from commfold.fx.edit import erase_if_dead

# shape queries: pure, they read only a tensor's metadata
SIZE_QUERIES = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default)


def drop_dead_size_queries(graph: fx.Graph) -> int:
    """Erase shape queries nothing reads; their number."""
    dead = [n for n in graph.nodes if n.op == "call_function" and n.target in SIZE_QUERIES
            and not n.users]
    for n in dead:
        graph.erase_node(n)
    return len(dead)


def fold_readbacks(graph: fx.Graph) -> int:
    """Replace each read-back slice by the values scattered, in graph order (a fold
    can make a later slice one); returns how many."""
    from commfold.patterns.slice_writeback import read_back  # the checkout's patterns

    n = 0
    for node in list(graph.nodes):
        src = None if node._erased else read_back(node)
        if src is None:
            continue
        scatter = node.args[0]
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        erase_if_dead(scatter)
        n += 1
    return n


STEPS: tuple[tuple[str, Callable[[fx.Graph], int]], ...] = (
    ("dead shape queries erased", drop_dead_size_queries),
    ("slice read-backs folded", fold_readbacks),
)


def canonicalize(graph: fx.Graph) -> dict[str, int]:
    """Run every step on `graph`, in place; {step: changes} for the steps that changed
    something."""
    changed = {}
    for name, step in STEPS:
        n = step(graph)
        if n:
            changed[name] = n
    return changed
