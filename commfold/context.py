"""What a pass gets besides the graph: the config and a way to record decisions."""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from commfold.config import Config
from commfold.report import (AlreadyDone, Comm, NearMiss, Report, Rewrite, source_code,
                             source_location)


@dataclass
class PassContext:
    graph: fx.Graph
    config: Config
    report: Report
    pass_name: str = ""

    def rewrote(self, pattern: str, node: fx.Node, before: Comm, after: Comm,
                extra_memory_bytes: int = 0, detail: str = "") -> None:
        self.report.rewrites.append(Rewrite(
            self.pass_name, pattern, source_location(node), before, after,
            extra_memory_bytes, detail))

    def skipped(self, pattern: str, node: fx.Node, reason: str) -> None:
        """Record a near-miss. `reason` must not hold rank-local values (shard bounds,
        handles): reasons enter the rank-consistency fingerprint."""
        self.report.near_misses.append(
            NearMiss(self.pass_name, pattern, source_location(node), reason, source_code(node)))

    def already(self, pattern: str, node: fx.Node, by: str) -> None:
        """Record a site another library already rewrote as this pass would."""
        self.report.already_done.append(
            AlreadyDone(self.pass_name, pattern, source_location(node), by))

    def matches(self, pattern: str, candidates, match):
        """Yield match(node) for each candidate node still in the graph: None means
        "nothing here" (no record); a Miss is recorded as a near-miss of `pattern`."""
        for node in candidates:
            if node._erased:  # taken by an earlier rewrite
                continue
            m = match(node)
            if m is None:
                continue
            if not m:
                self.skipped(pattern, m.node or node, m.reason)
                continue
            yield m
