"""commfold inside vLLM, two routes:

1. ``LLM(..., compilation_config={"inductor_passes":
   {"post_grad_custom_post_pass": "commfold.vllm_pass"}})``: vLLM resolves the name
   with ``__import__("commfold").__dict__["vllm_pass"]`` - the ready pass below.
2. ``COMMFOLD_VLLM=1 vllm serve ... -tp N``: ``register()``, the vLLM general plugin
   (entry point group ``vllm.general_plugins``), adds the pass to every VllmConfig
   (composed with a post-grad pass already there) and gives draft models that lack
   ``get_top_tokens`` commfold's local-argmax one.

Options come from the environment, read where the pass is built (vLLM pickles the
built pass into its worker processes): COMMFOLD_PASSES (comma-separated pass names),
COMMFOLD_REPLICATE_MAX_BYTES. COMMFOLD_REPORT_DIR makes every process (each rank)
write its reports there as JSON; COMMFOLD_COMM_LOG_DIR makes every worker rank log
the collectives of each engine step (commfold.vllm_comm_log; with or without
COMMFOLD_VLLM).

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
import os
import sys

from . import vllm_comm_log, vllm_target_pick
from .config import Config
from .manager import CommfoldPass

ENV_ON = "COMMFOLD_VLLM"
ENV_PASSES = "COMMFOLD_PASSES"
ENV_REPLICATE = "COMMFOLD_REPLICATE_MAX_BYTES"
PASS_KEY = "post_grad_custom_post_pass"
_INDUCTOR_PASS_MODULE = "vllm.compilation.passes.inductor_pass"


def enabled(environ=os.environ) -> bool:
    return environ.get(ENV_ON, "").strip().lower() in ("1", "true", "yes", "on")


def config_from_env(environ=os.environ) -> Config:
    options = {}
    if environ.get(ENV_PASSES, "").strip():
        options["passes"] = tuple(p.strip() for p in environ[ENV_PASSES].split(",") if p.strip())
    if environ.get(ENV_REPLICATE, "").strip():
        options["replicate_max_bytes"] = int(environ[ENV_REPLICATE])
    return Config(**options)


class VllmCommfoldPass(CommfoldPass):
    """CommfoldPass with what vLLM's pass manager asks of an InductorPass."""

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
        compile_config[PASS_KEY] = VllmCommfoldPass(config_from_env(), then=current)


def register() -> None:
    """vLLM general-plugin entry point; vLLM calls it in every process it starts."""
    import importlib

    importlib.import_module(_INDUCTOR_PASS_MODULE)
    register_inductor_pass()
    _hook_vllm_config()
    vllm_comm_log.install()  # only with COMMFOLD_COMM_LOG_DIR set
    if enabled():
        _hook_draft_models()
        vllm_target_pick.install()  # COMMFOLD_TARGET_PICK=0 leaves it off


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


def _hook_draft_models() -> None:
    """Draft proposers with use_local_argmax_reduction refuse a drafter without
    get_top_tokens: give such drafters commfold's (built from their compute_logits)."""
    from vllm.v1.spec_decode import draft_model, llm_base_proposer

    from .vllm_top_tokens import install_get_top_tokens

    for cls in (llm_base_proposer.SpecDecodeBaseProposer, draft_model.DraftModelProposer):
        original = cls.__dict__.get("_get_model")
        if original is None or getattr(original, "_commfold", False):
            continue

        def _get_model(self, _original=original):
            model = _original(self)
            if getattr(self, "use_local_argmax_reduction", False):
                install_get_top_tokens(model)
            return model

        _get_model._commfold = True
        cls._get_model = _get_model


# The pass vLLM's compilation config names as "commfold.vllm_pass" (re-exported by
# commfold/__init__.py): options from the environment of the importing process.
vllm_pass = VllmCommfoldPass(config_from_env())
register_inductor_pass()
