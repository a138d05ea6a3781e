"""One switch, per process, that sends every target-pick step to vLLM's own path
(noted "vLLM (paused)" in the step log): the V1 hook, both V2 hook sets and the prompt
logprobs read it here, so comparing commfold's pick with vLLM's on one engine (the
same weights and compiled forward: benchmarks/bench_vllm_engine.py's in-engine A/B)
needs no hook's private state. Call ``pause`` in every worker, e.g. through
``LLM.collective_rpc`` (harness.vllm_engine.pause_target_pick)."""
from __future__ import annotations

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
