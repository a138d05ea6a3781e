"""Every runtime hook commfold puts into vLLM, declared once as data: its row (the line
it logs at load, `commfold doctor`'s table, tools/vllm_compat.py's matrix), the model
runner and vLLM releases it applies to, the points of vLLM's code it relies on
(commfold.vllm.compat.hook_points), how to install it (logging its one line, on or off and
why) and how to undo it (hook_points.unwrap_hook: tests restore vLLM's classes). The
plugin, the doctor, the compat tool and the tests iterate HOOKS and know no hook
module; the hook modules know nothing of each other's state."""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from commfold.vllm.spec_decode import draft, draft_sampled, draft_v1, draft_v2, shard_verify
from commfold.vllm.spec_decode.draft_choice import PICK, TOP_TOKENS
from commfold.vllm import graph_passes
from commfold.vllm.sample import sampled_pick, shard_grammar
from commfold.vllm.observe import step_log
from commfold.vllm.target import target_pick
from commfold.vllm.target import target_pick_v2
from commfold.vllm.compat import releases
from commfold.vllm.compat.runtime import HookState, Runner

Environ = Mapping[str, str]


@dataclass(frozen=True)
class Hook:
    """One hook (or one release range's set of it) on one model runner."""
    name: str  # its row: the line it logs, the doctor's table
    runner: int | None  # the model runner it acts on (None: either)
    points: tuple  # hook_points: ((module:Attr.path, text | Pinned | alternatives), ...)
    state: Callable[[Environ, Runner], HookState]  # on or off and why; installs nothing
    install: Callable[[Environ, Runner], bool]  # logs the state's line; True when on
    uninstall: Callable[[], None]
    since: tuple[int, ...] | None = None  # the vLLM releases it covers: [since, until)
    until: tuple[int, ...] | None = None
    detail: str = ""  # which set of the hook (the compat matrix's row)
    plugin: bool = True  # off unless COMMFOLD_VLLM=1 (else its own variable)
    wraps: bool = True  # False: a part of another hook's pick (its row: whether it acts)

    def covers(self, found: tuple[int, ...] | None) -> bool:
        """Whether it applies to vLLM release `found` (unknown, None: the newest set)."""
        if found is None:
            return self.until is None
        return (self.since is None or found >= self.since) and \
            (self.until is None or found < self.until)

    def label(self) -> str:
        """Its row in tools/vllm_compat.py's matrix."""
        if self.runner is None:
            return self.name
        return f"{self.name} (V{self.runner}" + (f": {self.detail})" if self.detail else ")")


def _draft(what: str, hook: str, environ: Environ, runner: Runner):
    return getattr(draft, what)(hook, graph_passes.config_from_env(environ), environ, runner)


HOOKS: tuple[Hook, ...] = (
    Hook(graph_passes.PASSES_HOOK, None, graph_passes.HOOK_POINTS,
         lambda environ, runner: graph_passes.passes_state(environ),
         lambda environ, runner: graph_passes.install(environ), graph_passes.uninstall,
         plugin=False),
    *(Hook(step_log.HOOK, v, points, step_log.state, step_log.install, step_log.uninstall,
           plugin=False)
      for v, points in ((1, step_log.HOOK_POINTS), (2, step_log.HOOK_POINTS_V2))),
    *(Hook(hook, v, points[hook], partial(_draft, "state", hook),
           partial(_draft, "install", hook), partial(draft.uninstall, hook))
      for v, points in ((1, draft_v1.HOOK_POINTS), (2, draft_v2.HOOK_POINTS))
      for hook in (PICK, TOP_TOKENS)),
    Hook(target_pick.HOOK, 1, target_pick.HOOK_POINTS, target_pick.state, target_pick.install,
         target_pick.uninstall),
    *(Hook(target_pick_v2.HOOK, 2, s.points, target_pick_v2.state, target_pick_v2.install,
           target_pick_v2.uninstall, since=s.since, until=s.until, detail=s.label())
      for s in target_pick_v2.HOOK_SETS),
    Hook(sampled_pick.HOOK, 2, sampled_pick.POINTS, sampled_pick.state, sampled_pick.install,
         sampled_pick.uninstall, wraps=False),
    Hook(shard_grammar.HOOK, 2, shard_grammar.POINTS, shard_grammar.state,
         shard_grammar.install, shard_grammar.uninstall, wraps=False),
    # its kernels launched as each claimed release launches them (verify_kernels)
    Hook(shard_verify.HOOK, 2, shard_verify.POINTS, shard_verify.state,
         shard_verify.install, shard_verify.uninstall, wraps=False),
    # probabilistic drafts from the drafter's shard: for shard_verify's verification
    # (the cache a tensor up to 0.33, a DraftLogitsCache in 0.34)
    *(Hook(draft_sampled.HOOK, 2, points, draft_sampled.state, draft_sampled.install,
           draft_sampled.uninstall, since=since, until=until, detail=detail)
      for points, since, until, detail in draft_sampled.SETS),
)


def of(runner: Runner, found: tuple[int, ...] | None = None) -> list[Hook]:
    """The hooks for the runner vLLM will build (V1's when it would refuse the setting)
    and vLLM release `found` (when None, the claimed release this vLLM is read as:
    commfold.vllm.compat.releases.here), in install order."""
    version = 2 if runner.version == 2 else 1
    found = found if found is not None else releases.here().numbers
    return [h for h in HOOKS if h.runner in (None, version) and (h.runner == 1 or h.covers(found))]


def states(enabled: bool, environ: Environ = os.environ, runner: Runner | None = None
           ) -> list[HookState]:
    """Every hook's state, installing nothing (`enabled`: COMMFOLD_VLLM=1)."""
    from commfold.vllm.compat.runtime import runner_choice

    runner = runner or runner_choice(environ)
    return [h.state(environ, runner) if enabled or not h.plugin else unasked(h)
            for h in of(runner)]


def unasked(hook: Hook) -> HookState:
    return HookState(hook.name, False, f"{graph_passes.ENV_ON} unset")


def install(enabled: bool, environ: Environ = os.environ, runner: Runner | None = None
            ) -> None:
    """Install every hook of `runner` in order, each logging its one line."""
    from commfold.vllm.compat.runtime import runner_choice

    runner = runner or runner_choice(environ)
    for hook in of(runner):
        if enabled or not hook.plugin:
            hook.install(environ, runner)
        else:
            unasked(hook).log()


def uninstall() -> None:
    """Undo every hook, newest first (tests)."""
    for hook in reversed(HOOKS):
        hook.uninstall()
