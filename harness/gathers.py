"""The vocab gather test programs compile, spelled so that Dynamo traces it on every
torch commfold runs on."""
from __future__ import annotations

import torch.distributed._functional_collectives as funcol

from commfold.cli.demo_model import gather_last_dim
from commfold.torch_compat import torch_version


def all_gather_last_dim(x, group):
    """``funcol.all_gather_tensor(x, -1, group)`` where Dynamo traces it in the graph
    (torch >= 2.13); before, a gather on another dim is a graph break (the gather
    would run outside the compiled graph), so ``gather_last_dim``'s dim-0 spelling."""
    if torch_version() >= (2, 13):
        return funcol.all_gather_tensor(x, -1, group)
    return gather_last_dim(x, group)
