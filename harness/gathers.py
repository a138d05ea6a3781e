"""The vocab gather the test programs compile, spelled so that Dynamo traces it on
every torch commfold runs on."""
from __future__ import annotations

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commfold.cli.demo_model import gather_last_dim
from commfold.torch_compat import torch_version


# read once: a version check inside the traced function could break its graph
GATHER_ON_LAST_DIM_TRACES = torch_version() >= (2, 13)


def all_gather_last_dim(x):
    """``funcol.all_gather_tensor(x, -1, dist.group.WORLD)`` where Dynamo traces it in
    the graph (torch >= 2.13); before, a gather on a dim other than 0 is a graph break
    (Dynamo skips torch._utils._maybe_view_chunk_cat: the gather would run outside the
    compiled graph), so ``gather_last_dim``'s dim-0 spelling there."""
    if GATHER_ON_LAST_DIM_TRACES:
        return funcol.all_gather_tensor(x, -1, dist.group.WORLD)
    return gather_last_dim(x, dist.group.WORLD)
