"""The graph passes' hook: commfold's pass in every VllmConfig vLLM builds (with
COMMFOLD_VLLM=1, composed with a post-grad pass already there), vLLM's caches keyed on
commfold's uuid, and the options the pass reads from the environment (see
commfold.vllm.plugin, the vLLM plugin that installs it with the runtime hooks:
commfold.vllm.compat.hooks)."""
from __future__ import annotations

import copy
import os
import sys

from commfold.config import ALL_PASSES, FUSED_SAMPLER_STEPS, Config, unknown_passes
from commfold.manager import CommfoldPass
from commfold.vllm import compile_state
from commfold.vllm.compat import hook_points, runtime
from commfold.vllm.compat.runtime import HookState

ENV_ON = "COMMFOLD_VLLM"
ENV_PASSES = "COMMFOLD_PASSES"
ENV_REPLICATE = "COMMFOLD_REPLICATE_MAX_BYTES"
ENV_REPLICATE_HEAD = "COMMFOLD_REPLICATE_HEAD_MAX_BYTES"
ENV_COST_RULE = "COMMFOLD_FUSE_COST_RULE"
ENV_FUSED_SAMPLER = "COMMFOLD_FUSED_SAMPLER_STEPS"
PASS_KEY = "post_grad_custom_post_pass"
INDUCTOR_PASS_MODULE = "vllm.compilation.passes.inductor_pass"
PASSES_HOOK = compile_state.HOOK
# what it relies on in vLLM (tools/vllm_compat.py lists them; hook_points)
HOOK_POINTS = (("vllm.config:VllmConfig.__post_init__", None),
               (f"{INDUCTOR_PASS_MODULE}:InductorPass", None))
assumed_runner: runtime.Runner | None = None  # the runner the hooks assumed (register())


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
    fused = environ.get(ENV_FUSED_SAMPLER, "").strip()
    if fused:
        if fused not in FUSED_SAMPLER_STEPS:
            raise EnvError(f"commfold: {ENV_FUSED_SAMPLER}={fused!r}: set it to vllm (the "
                           "default: vLLM's fused top-k / top-p sampler draws those steps) "
                           "or gumbel (commfold draws them from the shards on V2's Gumbel "
                           "path: equal in distribution)")
        options["fused_sampler_steps"] = fused
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
    mod = sys.modules.get(INDUCTOR_PASS_MODULE)
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
    """Key vLLM's caches on commfold's uuid, and add commfold when COMMFOLD_VLLM=1; then
    log whether the passes run under this final config (compile_state, once)."""
    compile_config = vllm_config.compilation_config.inductor_compile_config
    current = compile_config.get(PASS_KEY)
    unwrapped = _unwrap(current)
    named = isinstance(unwrapped, CommfoldPass)
    if named:
        if not isinstance(unwrapped, VllmCommfoldPass):  # same state, vLLM's interface
            unwrapped = copy.copy(unwrapped)
            unwrapped.__class__ = VllmCommfoldPass
        compile_config[PASS_KEY] = unwrapped
    elif enabled():
        compile_config[PASS_KEY] = VllmCommfoldPass(then=current)  # options: environment
    compile_state.log_final(vllm_config, _unwrap(compile_config.get(PASS_KEY))
                            if named or enabled() else None)
    if enabled() and assumed_runner is not None:
        runtime.confirm_runner(vllm_config, assumed_runner)


def has_pass(vllm_config) -> bool:
    """Whether commfold's pass is in this config's post-grad passes."""
    current = vllm_config.compilation_config.inductor_compile_config.get(PASS_KEY)
    return isinstance(_unwrap(current), CommfoldPass)


def passes_state(environ=os.environ, vllm_config=None) -> HookState:
    """The graph passes' state: under `vllm_config`, an engine's final config, whether a
    graph reaches them (compile_state); without one, only whether they are asked for."""
    if vllm_config is not None:
        there = has_pass(vllm_config) or enabled(environ)
        return compile_state.state(vllm_config, there, there, environ)
    if enabled(environ):
        return HookState(PASSES_HOOK, True, f"{ENV_ON}=1: added to every VllmConfig's "
                         "post-grad passes; whether a graph reaches them is the engine's "
                         "final compilation config's answer (logged once it is final)")
    return HookState(PASSES_HOOK, False, f"{ENV_ON} unset (a compilation_config naming "
                     "commfold.vllm_pass still runs them)")


def install(environ=os.environ) -> bool:
    """The graph passes' hook: every VllmConfig through ``configure``. With
    COMMFOLD_VLLM=1 its line waits for the engine's final compilation config
    (compile_state: nothing at load, where the mode is not known yet); unset, the line
    is logged now. True when the passes are asked for."""
    _hook_vllm_config()
    if not enabled(environ):
        passes_state(environ).log()
    return enabled(environ)


def _hook_vllm_config() -> None:
    """Every VllmConfig configured by ``configure`` once vLLM has built it."""
    from vllm.config import VllmConfig

    def make(original):
        def __post_init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            configure(self)
        return __post_init__

    hook_points.wrap(VllmConfig, "__post_init__", make, PASSES_HOOK)


def uninstall() -> None:
    """Undo the VllmConfig hook (tests)."""
    hook_points.unwrap_hook(PASSES_HOOK)
