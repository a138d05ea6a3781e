"""The pass manager: an Inductor CustomGraphPass that canonicalizes a post-grad graph
(commfold.canonicalize), runs commfold's passes on it, never breaks a compile, and
keys Inductor's cache on code + config."""
from __future__ import annotations

import hashlib
import logging
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from commfold.canonicalize import canonicalize
from commfold.config import Config
from commfold.context import PassContext
from commfold.fx.checkpoint import Checkpoint, restore, snapshot
from commfold.report import PassError, Report, publish
from commfold.torch_compat import warn_if_unsupported

log = logging.getLogger("commfold")

# the name canonicalization's failure is recorded under in Report.errors
CANONICALIZE = "canonicalize"


def _registry() -> dict:
    """commfold.passes.PASSES, imported on first use: `import commfold` stays light."""
    from commfold.passes import PASSES

    return PASSES


@lru_cache(maxsize=1)
def code_hash() -> str:
    """Hash of every source file of the installed package (core, passes, patterns)."""
    import commfold.passes
    import commfold.patterns

    h = hashlib.sha256()
    roots = {Path(__file__).parent,  # the core package: this module's folder
             *(Path(m.__file__).parent for m in (commfold.passes, commfold.patterns)
               if m.__file__)}
    for root in sorted(roots):
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _pass_functions(names) -> str:
    """Which function runs each pass: a pass swapped at run time (a plugin, a test's
    fault injection) must not be served the cached graph of the one it replaced."""
    registry = _registry()
    return ",".join(f"{n}={getattr(registry.get(n), '__module__', '?')}."
                    f"{getattr(registry.get(n), '__qualname__', '?')}" for n in names)


# Observation hook (used by `commfold diff`): while `observing(...)` is active, every
# CommfoldPass in this process calls observer(pass_name, graph_before, graph_after,
# report) after each pass (graph copies, so later passes do not change them), and, if
# `passes` is given, runs those passes instead of its configured ones (other options kept).
_observer: Callable[[str, fx.Graph | None, fx.Graph, Report], None] | None = None
_forced_passes: tuple[str, ...] | None = None


@contextmanager
def observing(observer, passes=None):
    """Report every pass's before/after graph to `observer` (and optionally run
    `passes` instead of each CommfoldPass's own) while active. Observed passes bypass
    Inductor's cache (uuid() is None): a cache hit would skip the pass and show nothing."""
    global _observer, _forced_passes
    saved = _observer, _forced_passes
    _observer, _forced_passes = observer, (tuple(passes) if passes is not None else None)
    try:
        yield
    finally:
        _observer, _forced_passes = saved


class CommfoldPass(CustomGraphPass):
    """Runs the configured passes on a post-grad FX graph, in place.

    ``then``: another post-grad pass (e.g. the user's own
    ``post_grad_custom_post_pass``) that runs after commfold's, so setting commfold
    never silently drops a user's pass.
    ``on_report``: called with each graph's Report (the backend saves it for cache hits).
    """

    def __init__(self, config: Config | None = None, then=None, on_report=None):
        self._config = config or Config()
        self.then = then
        self.on_report = on_report  # called with each published Report

    @property
    def config(self) -> Config:
        return self._config

    def __call__(self, graph: fx.Graph) -> None:
        warn_if_unsupported()
        config = self.config
        if _forced_passes is not None:
            config = config.replace(passes=_forced_passes)
        report = Report(passes=config.passes)
        try:
            self._run(graph, report, config)
        finally:
            publish(report)
            if self.on_report is not None:
                self.on_report(report)
        if self.then is not None:
            self.then(graph)

    def _run(self, graph: fx.Graph, report: Report, config: Config) -> None:
        """Canonicalize the graph, then run the passes; if one raises, put the graph
        back as canonicalization left it (one snapshot, taken up front) and run the
        others again without it. Passes are deterministic, so the rerun gives the same
        rewrites; failures are rare, so the saved state is a cheap Checkpoint, rebuilt
        into nodes only on failure.

        The graph is linted once after all passes (a malformed rewrite fails here, not
        in Inductor); if that fails, the passes rerun with a lint after each, which
        names the pass to drop. Strict and observed runs lint after each pass at once."""
        registry = _registry()
        saved = self._canonicalize(graph, report, config)
        failed: dict[str, str] = {}
        lint_each = config.strict or _observer is not None
        while True:
            report.rewrites.clear()
            report.near_misses.clear()
            observed = []  # observer calls of this attempt, delivered once it succeeds
            current = None
            try:
                for name in config.passes:
                    if name in failed:
                        continue
                    current = name
                    before = snapshot(graph) if _observer is not None else None
                    t0 = time.perf_counter()
                    registry[name](PassContext(graph, config, report, name))
                    if lint_each:
                        graph.lint()
                    report.pass_seconds[name] = time.perf_counter() - t0
                    if _observer is not None:
                        observed.append((name, before, snapshot(graph)))
                if not lint_each:  # also when no rewrite was recorded
                    current = None
                    graph.lint()
                break
            except Exception as e:  # never break a user's compile
                if config.strict:
                    raise
                restore(graph, saved)
                if current is None:  # the final lint: find the pass that broke the graph
                    lint_each = True
                    continue
                failed[current] = f"{type(e).__name__}: {e}"
                log.debug("commfold pass %s failed:\n%s", current, traceback.format_exc())
        report.errors.extend(PassError(name, err) for name, err in failed.items())
        for name, before, after in observed:  # none unless an observer is set
            if _observer is not None:
                _observer(name, before, after, report)

    def _canonicalize(self, graph: fx.Graph, report: Report, config: Config
                      ) -> Checkpoint | None:
        """Canonicalize in place, recording what changed in the report; returns the
        checkpoint failed passes restore (None when strict: nothing is restored). A
        failing canonicalization leaves the graph as it came, with an error in the
        report (strict raises); the passes then run on the graph as it came."""
        saved = None if config.strict else Checkpoint(graph)
        try:
            changed = canonicalize(graph)
            if changed:
                graph.lint()
        except Exception as e:
            if config.strict:
                raise
            restore(graph, saved)
            report.errors.append(PassError(CANONICALIZE, f"{type(e).__name__}: {e}"))
            log.debug("commfold canonicalization failed:\n%s", traceback.format_exc())
            return saved
        report.canonicalized = changed
        return Checkpoint(graph) if changed and not config.strict else saved

    def uuid(self):
        if _observer is not None:
            return None  # observed: always run the pass (a cache hit would skip it)
        parts = [code_hash(), self.config.key(), _pass_functions(self.config.passes)]
        if self.then is not None:
            then_uuid = self.then.uuid() if hasattr(self.then, "uuid") else None
            if then_uuid is None:
                return None  # an unkeyed user pass: bypass the cache rather than risk it
            parts.append(repr(then_uuid))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
