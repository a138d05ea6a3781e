"""The functionalized spelling of an in-place op on a slice: ``x[:, :V] *= c`` (vLLM's
LogitsProcessor scales its gathered logits so) becomes

    s = slice_scatter(base, f(slice(x, d, a, b)), d, a, b);  y = slice(s, d, a, b)

where ``y`` reads back exactly the scattered values. Left so, the gathered row has
two consumers and hides every pick behind it. ``read_back`` recognizes such a read;
the manager's canonicalization (commfold.canonicalize) points each one at the
scattered values themselves (bit-identical: the same tensor) before any pass runs."""
from __future__ import annotations

import torch.fx as fx

from commfold.fx.nodes import arg, dtype_of, is_call, same_shape

from .common import aten

_BOUNDS = ("dim", "start", "end", "step")


def read_back(node: fx.Node) -> fx.Node | None:
    """The scattered values `node` reads back, when it is such a slice."""
    if not is_call(node, aten.slice.Tensor):
        return None
    scatter = node.args[0]
    if not is_call(scatter, aten.slice_scatter.default):
        return None
    src = scatter.args[1]
    if isinstance(src, fx.Node) \
            and [arg(node, k) for k in _BOUNDS] == [arg(scatter, k) for k in _BOUNDS] \
            and same_shape(node, src) and dtype_of(node) == dtype_of(src):
        return src
    return None
