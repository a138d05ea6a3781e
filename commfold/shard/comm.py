"""What the shard math asks of a communicator: its rank, its size, an all-gather.

commfold.distributed.collectives.Communicator has these, but reaches vLLM's groups
for vLLM's communicators; the math names only this protocol, so it imports no vLLM
and a test can pass N ranks simulated in one process (harness.fake_comm).
"""
from __future__ import annotations

from typing import Protocol

import torch


class Comm(Protocol):
    def rank(self) -> int: ...

    def world_size(self) -> int: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along dim 0, in rank order."""
        ...
