"""commfold inside vLLM, two routes:

1. ``LLM(..., compilation_config={"inductor_passes":
   {"post_grad_custom_post_pass": "commfold.vllm_pass"}})``: vLLM resolves the name
   with ``__import__("commfold").__dict__["vllm_pass"]`` - the ready pass below.
2. ``COMMFOLD_VLLM=1 vllm serve ... -tp N``: ``register()``, the vLLM general plugin
   (entry point group ``vllm.general_plugins``), adds the pass to every VllmConfig
   (composed with a post-grad pass already there) and hooks the speculative drafter
   (commfold.vllm.draft): its greedy pick without a full-vocab gather, and a
   ``get_top_tokens`` for drafters that lack one; and the target's pick
   (commfold.vllm.target_pick on the V1 runner, target_pick_v2 on V2). Every hook
   logs one line at load, on or off and why
   (the table `commfold doctor` prints; commfold.vllm.runtime).

Options come from the environment, read when the pass is first used (its uuid() or a
run; vLLM asks for the uuid when it builds its config, before it pickles the pass into
its worker processes): COMMFOLD_PASSES (comma-separated pass names),
COMMFOLD_REPLICATE_MAX_BYTES, COMMFOLD_REPLICATE_HEAD_MAX_BYTES, COMMFOLD_FUSE_COST_RULE
(Config's fields of those names). Importing this module reads no environment and cannot
fail on a bad value; the first use raises one line that says what to set.
COMMFOLD_REPORT_DIR makes every process (each rank) write its reports there as JSON;
COMMFOLD_COMM_LOG_DIR makes every worker rank log the collectives of each engine step
(commfold.vllm.step_log; with or without COMMFOLD_VLLM).

Caches: vLLM keys its compile cache and Inductor its FX graph cache on the pass's
``uuid()`` (commfold's code hash + config) only if vLLM takes the pass as its own
``InductorPass``; otherwise vLLM wraps it and keys on the wrapper class's source,
which would let a graph compiled under another commfold version or config be served.
So VllmCommfoldPass is registered as a virtual subclass of vLLM's InductorPass (when
vLLM is loaded; this module never imports vLLM by itself) and the plugin unwraps a
pass that vLLM wrapped before the registration.
"""
from __future__ import annotations

import copy
import logging
import os
import sys

from commfold.vllm import hook_points
from commfold.vllm import step_log
from commfold.vllm import draft
from commfold.vllm import runtime
from commfold.vllm import target_pick
from commfold.vllm import target_pick_v2
from commfold.config import ALL_PASSES, Config, unknown_passes
from commfold.manager import CommfoldPass
from commfold.vllm.runtime import HookState

log = logging.getLogger("commfold")

ENV_ON = "COMMFOLD_VLLM"
ENV_PASSES = "COMMFOLD_PASSES"
ENV_REPLICATE = "COMMFOLD_REPLICATE_MAX_BYTES"
ENV_REPLICATE_HEAD = "COMMFOLD_REPLICATE_HEAD_MAX_BYTES"
ENV_COST_RULE = "COMMFOLD_FUSE_COST_RULE"
PASS_KEY = "post_grad_custom_post_pass"
_INDUCTOR_PASS_MODULE = "vllm.compilation.passes.inductor_pass"
PASSES_HOOK = "graph passes"
_runner: runtime.Runner | None = None  # the runner the hooks assumed at register()


def enabled(environ=os.environ) -> bool:
    return environ.get(ENV_ON, "").strip().lower() in ("1", "true", "yes", "on")


class EnvError(ValueError):
    """A COMMFOLD_* variable holds a value commfold cannot use (one line: what to set)."""


def config_from_env(environ=os.environ) -> Config:
    options = {}
    passes = environ.get(ENV_PASSES, "").strip()
    if passes:
        options["passes"] = tuple(p.strip() for p in passes.split(",") if p.strip())
        unknown = unknown_passes(options["passes"])
        if unknown:
            raise EnvError(f"commfold: {ENV_PASSES}={passes!r} names unknown pass(es) "
                           f"{unknown}; set it to some of {','.join(ALL_PASSES)} "
                           f"(comma-separated) or unset it for all")
    for name, field in ((ENV_REPLICATE, "replicate_max_bytes"),
                        (ENV_REPLICATE_HEAD, "replicate_head_max_bytes")):
        limit = environ.get(name, "").strip()
        if limit:
            if not limit.isdigit():
                default = getattr(Config, field)
                raise EnvError(f"commfold: {name}={limit!r} is not a byte count; set it to "
                               f"an integer >= 0 (e.g. 1048576) or unset it for the default"
                               f" ({default if default is not None else 'measured per device'})")
            options[field] = int(limit)
    rule = environ.get(ENV_COST_RULE, "").strip()
    if rule:
        if rule not in ("0", "1"):
            raise EnvError(f"commfold: {ENV_COST_RULE}={rule!r}: set it to 0 (fuse every "
                           "all-reduce + RMSNorm site) or 1 (the default: not where the "
                           "fused op was measured slower)")
        options["fuse_cost_rule"] = rule == "1"
    return Config(**options)


class VllmCommfoldPass(CommfoldPass):
    """CommfoldPass with what vLLM's pass manager asks of an InductorPass. Without a
    config, its options come from the environment at first use (config_from_env)."""

    def __init__(self, config: Config | None = None, then=None, on_report=None):
        super().__init__(config, then, on_report)
        self._config = config  # None: read from the environment at first use

    @property
    def config(self) -> Config:
        if self._config is None:
            self._config = config_from_env()
        return self._config

    def is_applicable_for_range(self, compile_range) -> bool:
        return True  # the rewrites do not depend on the token count


def register_inductor_pass() -> bool:
    """Make vLLM see VllmCommfoldPass as its InductorPass (if vLLM is loaded)."""
    mod = sys.modules.get(_INDUCTOR_PASS_MODULE)
    if mod is None:
        return False
    if not issubclass(VllmCommfoldPass, mod.InductorPass):
        mod.InductorPass.register(VllmCommfoldPass)
    return True


def _unwrap(pass_):
    """A CommfoldPass that vLLM wrapped in a CallableInductorPass, else pass_."""
    inner = getattr(pass_, "callable", None)
    return inner if isinstance(inner, CommfoldPass) else pass_


def configure(vllm_config) -> None:
    """Key vLLM's caches on commfold's uuid, and add commfold when COMMFOLD_VLLM=1."""
    compile_config = vllm_config.compilation_config.inductor_compile_config
    current = compile_config.get(PASS_KEY)
    unwrapped = _unwrap(current)
    if isinstance(unwrapped, CommfoldPass):
        if not isinstance(unwrapped, VllmCommfoldPass):  # same state, vLLM's interface
            unwrapped = copy.copy(unwrapped)
            unwrapped.__class__ = VllmCommfoldPass
        compile_config[PASS_KEY] = unwrapped
    elif enabled():
        compile_config[PASS_KEY] = VllmCommfoldPass(then=current)  # options: environment
    if enabled() and _runner is not None:
        runtime.confirm_runner(vllm_config, _runner)


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

    global _runner
    log_through_vllm()
    carry_to_ray_workers()
    importlib.import_module(_INDUCTOR_PASS_MODULE)
    register_inductor_pass()
    _hook_vllm_config()
    _runner = runtime.runner_choice()
    passes_state().log()
    step_log.install(runner=_runner)  # only with COMMFOLD_COMM_LOG_DIR set
    if enabled():
        draft.hook_proposers(config_from_env(), runner=_runner)
        target_pick_hook(_runner).install(runner=_runner)  # COMMFOLD_TARGET_PICK=0: off
    else:
        for state in _unwanted():
            state.log()


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


def passes_state(environ=os.environ) -> HookState:
    if enabled(environ):
        return HookState(PASSES_HOOK, True, f"{ENV_ON}=1: added to every VllmConfig's "
                         "post-grad passes (V1 and V2 runners alike)")
    return HookState(PASSES_HOOK, False, f"{ENV_ON} unset (a compilation_config naming "
                     "commfold.vllm_pass still runs them)")


def _unwanted() -> list[HookState]:
    return [HookState(hook, False, f"{ENV_ON} unset")
            for hook in (*draft.HOOK_POINTS, target_pick.HOOK)]


def hook_states(environ=os.environ, runner=None) -> list[HookState]:
    """Every hook's state in `environ`, installing nothing: what register() logs."""
    runner = runner or runtime.runner_choice(environ)
    states = [passes_state(environ), step_log.state(environ, runner)]
    if not enabled(environ):
        return states + _unwanted()
    return states + draft.states(config_from_env(environ), environ, runner) \
        + [target_pick_hook(runner).state(environ, runner)]


def target_pick_hook(runner: runtime.Runner):
    """The target-pick hook of the runner vLLM will build (one row either way)."""
    return target_pick_v2 if runner.version == 2 else target_pick


def _hook_vllm_config() -> None:
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, "_commfold", False):
        return

    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        configure(self)

    __post_init__._commfold = True
    VllmConfig.__post_init__ = __post_init__


# The pass vLLM's compilation config names as "commfold.vllm_pass" (re-exported by
# commfold/__init__.py; vLLM reads it from the module's __dict__, so it is an object,
# not a module __getattr__): options from the environment, read at first use.
vllm_pass = VllmCommfoldPass()
register_inductor_pass()
