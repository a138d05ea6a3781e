"""commfold in vLLM's speculative-decoding drafter (installed by the vLLM plugin in
every vLLM process when COMMFOLD_VLLM=1): the two hooks' state, install and undo. The
greedy draft pick (PICK) and a get_top_tokens for drafters without one under
use_local_argmax_reduction (TOP_TOKENS), in V1's proposers (draft_v1) or Model Runner
V2's speculators (draft_v2), which pick as commfold.vllm.spec_decode.draft_choice says.

Both hooks patch the proposers of the runner vLLM will build and log one line each at
install, on or off and why (commfold.vllm.compat.runtime); each checks the lines of vLLM's
code it relies on.
"""
from __future__ import annotations

import os

from commfold.config import Config
from commfold.vllm.compat import hook_points, runtime
from commfold.vllm.spec_decode import draft_v1, draft_v2
from commfold.vllm.spec_decode.draft_choice import PICK, PICK_PASSES, TOP_TOKENS, pick_config


def states(config: Config, environ=os.environ, runner=None) -> list:
    """The two hooks' states (runtime.HookState), installing nothing."""
    off = None if pick_config(config) else \
        f"COMMFOLD_PASSES has none of {', '.join(PICK_PASSES)}"
    runner = runner or runtime.runner_choice(environ)
    version = 2 if runner.version == 2 else 1
    points_of = draft_v2.HOOK_POINTS if version == 2 else draft_v1.HOOK_POINTS
    pinned = {PICK: draft_v2.sample_draft_unpinned} if version == 2 else {}
    return [runtime.gate(hook, off=off, environ=environ, runner=runner, version=version,
                         missing=lambda points=points, hook=hook: hook_points.missing(points)
                         + pinned.get(hook, list)())
            for hook, points in points_of.items()]


def state(hook: str, config: Config, environ=os.environ, runner=None):
    """One of the two hooks' state (PICK, TOP_TOKENS), installing nothing."""
    return dict(zip((PICK, TOP_TOKENS), states(config, environ, runner)))[hook]


def install(hook: str, config: Config, environ=os.environ, runner=None) -> bool:
    """One of the two hooks (PICK: the greedy draft pick; TOP_TOKENS: a get_top_tokens
    for drafters without one under use_local_argmax_reduction) on the proposers of the
    runner vLLM will build, logging its line; True when on. Idempotent."""
    runner = runner or runtime.runner_choice(environ)
    if not state(hook, config, environ, runner).log().on:
        return False
    hook_v = draft_v2.hook if runner.version == 2 else draft_v1.hook
    hook_v(pick_config(config), hook == PICK, hook == TOP_TOKENS)
    return True


def uninstall(hook: str) -> None:
    """Undo install(hook) (tests: vLLM's own methods back)."""
    hook_points.unwrap_hook(hook)
