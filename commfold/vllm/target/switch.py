"""The target pick's switches: ``COMMFOLD_TARGET_PICK`` (``enabled``; every mode of the
pick, V1 and V2, turns off with it: ``mode_state``), and one switch, per process, that
sends every target-pick step to vLLM's own path
(noted "vLLM (paused)" in the step log): the V1 hook, both V2 hook sets and the prompt
logprobs read it here, so comparing commfold's pick with vLLM's on one engine (the
same weights and compiled forward: benchmarks/bench_vllm_engine.py's in-engine A/B)
needs no hook's private state. Call ``pause`` in every worker, e.g. through
``LLM.collective_rpc`` (harness.vllm_engine.pause_target_pick)."""
from __future__ import annotations

import os

from commfold.vllm.compat import hook_points, runtime

ENV = "COMMFOLD_TARGET_PICK"

_paused = False


def pause(paused: bool = True) -> bool:
    """Send this process's target-pick steps to vLLM's path until ``pause(False)``;
    returns the previous setting."""
    global _paused
    was, _paused = _paused, bool(paused)
    return was


def paused() -> bool:
    """Whether ``pause()`` sends this process's steps to vLLM's path (both runners)."""
    return _paused


def enabled(environ=os.environ) -> bool:
    return environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def mode_state(hook: str, points, environ=os.environ, runner=None) -> runtime.HookState:
    """The state of a mode of the V2 target pick that wraps nothing (sampled steps,
    structured output, sampled verification): on while the V2 functions it repeats
    hold their pins (`points`); this hook's switch turns it off with the pick."""
    off = None if enabled(environ) else f"{ENV}=0"
    return runtime.gate(hook, off=off, missing=lambda: hook_points.missing(points),
                        environ=environ, runner=runner, version=2)
