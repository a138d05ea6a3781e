"""commfold inside vLLM, two routes:

1. ``LLM(..., compilation_config={"inductor_passes":
   {"post_grad_custom_post_pass": "commfold.vllm_pass"}})``: vLLM resolves the name
   with ``__import__("commfold").__dict__["vllm_pass"]`` - the ready pass below.
2. ``COMMFOLD_VLLM=1 vllm serve ... -tp N``: ``register()``, the vLLM general plugin
   (entry point group ``vllm.general_plugins``), adds the pass to every VllmConfig
   (composed with a post-grad pass already there) and hooks the speculative drafter
   (commfold.vllm.spec_decode.draft): its greedy pick without a full-vocab gather, and a
   ``get_top_tokens`` for drafters that lack one; and the target's pick
   (commfold.vllm.target.target_pick on the V1 runner, target_pick_v2 on V2): the hooks of
   commfold.vllm.compat.hooks.HOOKS, in order. Every hook logs one line at load, on or off
   and why (the table `commfold doctor` prints; commfold.vllm.compat.runtime).

Options come from the environment, read when the pass is first used (its uuid() or a
run; vLLM asks for the uuid when it builds its config, before it pickles the pass into
its worker processes): COMMFOLD_PASSES (comma-separated pass names),
COMMFOLD_REPLICATE_MAX_BYTES, COMMFOLD_REPLICATE_HEAD_MAX_BYTES, COMMFOLD_FUSE_COST_RULE
(Config's fields of those names). Importing this module reads no environment and cannot
fail on a bad value; the first use raises one line that says what to set.
COMMFOLD_REPORT_DIR makes every process (each rank) write its reports there as JSON;
COMMFOLD_COMM_LOG_DIR makes every worker rank log the collectives of each engine step
(commfold.vllm.observe.step_log; with or without COMMFOLD_VLLM).

Caches: vLLM keys its compile cache and Inductor its FX graph cache on the pass's
``uuid()`` (commfold's code hash + config) only if vLLM takes the pass as its own
``InductorPass``; otherwise vLLM wraps it and keys on the wrapper class's source,
which would let a graph compiled under another commfold version or config be served.
So VllmCommfoldPass is registered as a virtual subclass of vLLM's InductorPass (when
vLLM is loaded; this module never imports vLLM by itself) and the plugin unwraps a
pass that vLLM wrapped before the registration. The pass, its options and that
keying are commfold.vllm.graph_passes' (the "graph passes" hook), re-exported here.
"""
from __future__ import annotations

import logging
import os

from commfold.vllm import graph_passes
from commfold.vllm.compat import hook_points, hooks, runtime
from commfold.vllm.compat.runtime import HookState
# the graph passes' hook and the environment it reads: public here as well (the plugin's
# names since before they had a module of their own)
from commfold.vllm.graph_passes import (  # noqa: F401
    ENV_COST_RULE, ENV_ON, ENV_PASSES, ENV_REPLICATE, ENV_REPLICATE_HEAD, PASS_KEY,
    PASSES_HOOK, EnvError, VllmCommfoldPass, config_from_env, configure, enabled,
    passes_state, register_inductor_pass)

log = logging.getLogger("commfold")

RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
# where vLLM's Ray executor reads that list (tools/vllm_compat.py checks it per release)
RAY_POINTS = (("vllm.ray.ray_env:get_env_vars_to_copy",
               "envs.VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"),)


def carry_to_ray_workers(environ=os.environ) -> bool:
    """vLLM's Ray executor gives its workers only some of the driver's variables
    (vllm/ray/ray_env.py: VLLM_*, NCCL_*, HF_*, ... and the prefixes listed in
    VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY): list COMMFOLD_ there whenever a COMMFOLD_
    variable is set, so Ray workers run with the driver's commfold settings as `mp`
    workers (which inherit the environment) do. True when the list was extended."""
    if not any(k.startswith("COMMFOLD_") for k in environ):
        return False
    have = {p.strip() for p in environ.get(RAY_PREFIXES, "").split(",") if p.strip()}
    if "COMMFOLD_" in have:
        return False
    environ[RAY_PREFIXES] = ",".join(sorted(have | {"COMMFOLD_"}))
    gone = hook_points.missing(RAY_POINTS)
    if gone:
        log.warning("commfold: Ray workers may not get the COMMFOLD_* settings: vLLM no "
                    "longer reads %s where commfold expects it (%s); mp workers do",
                    RAY_PREFIXES, gone[0])
    else:
        log.info("commfold: %s lists COMMFOLD_: Ray workers get commfold's settings",
                 RAY_PREFIXES)
    return True


def register() -> None:
    """vLLM general-plugin entry point; vLLM calls it in every process it starts. Each
    hook logs one line, on or off and why (the table `commfold doctor` prints)."""
    import importlib

    log_through_vllm()
    carry_to_ray_workers()
    importlib.import_module(graph_passes.INDUCTOR_PASS_MODULE)
    register_inductor_pass()
    graph_passes.assumed_runner = runner = runtime.runner_choice()
    hooks.install(enabled(), os.environ, runner)  # commfold.vllm.compat.hooks.HOOKS, in order


class _ThroughVllm(logging.Handler):
    """Hands each record to the handlers vLLM gave its "vllm" logger (vLLM configures
    them in each process it starts, possibly after commfold's plugin has loaded)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def log_through_vllm() -> bool:
    """commfold's lines printed the way vLLM prints its own, in every engine process.
    vLLM configures only its "vllm" logger; without this, commfold's INFO lines (a hook
    on, or off for a reason that is not a problem) would reach no handler and be lost.
    Left alone when the application configured logging itself (root or commfold has a
    handler). True when the handler was attached."""
    if log.handlers or logging.getLogger().handlers:
        return False
    log.addHandler(_ThroughVllm())
    # a root handler added later (a library's logging.info() at import runs
    # basicConfig) would print every line a second time, in logging's bare format
    log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)  # vLLM's handler levels (VLLM_LOGGING_LEVEL) filter
    return True


def hook_states(environ=os.environ, runner=None) -> list[HookState]:
    """Every hook's state in `environ`, installing nothing: what register() logs."""
    return hooks.states(enabled(environ), environ, runner)


# The pass vLLM's compilation config names as "commfold.vllm_pass" (re-exported by
# commfold/__init__.py; vLLM reads it from the module's __dict__, so it is an object,
# not a module __getattr__): options from the environment, read at first use.
vllm_pass = VllmCommfoldPass()
register_inductor_pass()
