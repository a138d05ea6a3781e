"""The pass manager: an Inductor CustomGraphPass that runs commfold's passes on a
post-grad graph, never breaks a compile, and keys Inductor's cache on code + config."""
from __future__ import annotations

import hashlib
import logging
import time
import traceback
from functools import lru_cache
from pathlib import Path

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .config import Config
from .context import PassContext
from .graph import restore, snapshot
from .report import PassError, Report, publish

log = logging.getLogger("commfold")


def _registry() -> dict:
    from commfold.passes import PASSES

    return PASSES


@lru_cache(maxsize=1)
def code_hash() -> str:
    """Hash of every source file of the installed package (core, passes, patterns)."""
    import commfold
    import commfold.passes
    import commfold.patterns

    h = hashlib.sha256()
    roots = {Path(m.__file__).parent for m in (commfold, commfold.passes, commfold.patterns)}
    for root in sorted(roots):
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


class CommfoldPass(CustomGraphPass):
    """Runs the configured passes on a post-grad FX graph, in place.

    ``then``: another post-grad pass (e.g. the user's own
    ``post_grad_custom_post_pass``) that runs after commfold's, so setting commfold
    never silently drops a user's pass.
    """

    def __init__(self, config: Config | None = None, then=None):
        self.config = config or Config()
        self.then = then

    def __call__(self, graph: fx.Graph) -> None:
        report = Report(passes=self.config.passes)
        try:
            self._run(graph, report)
        finally:
            publish(report)
        if self.then is not None:
            self.then(graph)

    def _run(self, graph: fx.Graph, report: Report) -> None:
        registry = _registry()
        saved = None if self.config.strict else snapshot(graph)
        for name in self.config.passes:
            ctx = PassContext(graph, self.config, report, name)
            n_rewrites, n_misses = len(report.rewrites), len(report.near_misses)
            t0 = time.perf_counter()
            try:
                registry[name](ctx)
                graph.lint()
            except Exception as e:  # never break a user's compile
                if self.config.strict:
                    raise
                # Undo this pass: restore the graph as it was before it ran.
                restore(graph, saved)
                del report.rewrites[n_rewrites:], report.near_misses[n_misses:]
                report.errors.append(PassError(name, f"{type(e).__name__}: {e}"))
                log.debug("commfold pass %s failed:\n%s", name, traceback.format_exc())
            else:
                if saved is not None and len(report.rewrites) > n_rewrites:
                    saved = snapshot(graph)
            report.pass_seconds[name] = time.perf_counter() - t0

    def uuid(self):
        parts = [code_hash(), self.config.key()]
        if self.then is not None:
            then_uuid = self.then.uuid() if hasattr(self.then, "uuid") else None
            if then_uuid is None:
                return None  # an unkeyed user pass: bypass the cache rather than risk it
            parts.append(repr(then_uuid))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
