"""The hook registry (commfold.vllm.compat.hooks): every hook of this vLLM installs on and
uninstalls without a trace (every vLLM class and module function as before, no
commfold wrapper left), alone and all together in the plugin's order; the points each
hook declares are the ones its load-time check reads (what `commfold doctor`
reports); one pause switch stops every
target pick; the V1 target pick runs vLLM's own ``_sample`` (its bookkeeping
included) and its output equals vLLM's for the same step; no hook module reads
another's private names."""
from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from commfold.vllm.compat.runtime import Runner, v1_runner_present
from harness.vllm_models import init_vllm_tp, require_vllm_installed, shm_supported

pytestmark = require_vllm_installed()

ROOT = Path(__file__).resolve().parent.parent
RUNNERS = {1: Runner(1, "the test's choice"), 2: Runner(2, "the test's choice")}
needs_v1 = pytest.mark.skipif(not v1_runner_present(), reason="this vLLM has no V1 runner")
VERSIONS = [pytest.param(1, marks=needs_v1), 2]  # the runners (V1 gone from vLLM 0.34)


@pytest.fixture
def env(tmp_path) -> dict:
    """Every hook asked for (the step log too)."""
    return {"COMMFOLD_VLLM": "1", "COMMFOLD_COMM_LOG_DIR": str(tmp_path)}


def _namespaces() -> dict[tuple[str, str], object]:
    """(owner, name) -> value of every callable in every loaded vLLM module and class."""
    found = {}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "vllm" or mod_name.startswith("vllm.")):
            continue
        owners = [(mod_name, mod)] + [(f"{mod_name}:{o.__qualname__}", o)
                                      for o in list(vars(mod).values())
                                      if isinstance(o, type) and o.__module__ == mod_name]
        for where, owner in owners:
            for name, value in list(vars(owner).items()):
                if callable(value) or isinstance(value, (staticmethod, classmethod)):
                    found[(where, name)] = value
    return found


def _commfold_wrappers() -> list[str]:
    from commfold.vllm.compat.hook_points import wrapped_by

    return [f"{w}.{n}: {wrapped_by(v)}" for (w, n), v in _namespaces().items()
            if wrapped_by(v)]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_hook_installs_and_uninstalls_cleanly(version, env, monkeypatch):
    from commfold.vllm.compat import hooks

    runner = RUNNERS[version]
    chosen = hooks.of(runner)
    # sampled verification: V2's kernels as each claimed release launches them, and
    # probabilistic drafts for it, wherever this vLLM is read as a claimed release
    from commfold.vllm.compat import releases

    verify = drafts = version == 2 and releases.here().release is not None
    assert [h.name for h in chosen] == ["graph passes", "step log", "draft pick",
                                        "draft get_top_tokens", "target pick"] + \
        ["target pick: sampled steps", "target pick: structured output"] * (version == 2) + \
        ["target pick: sampled verification"] * verify + \
        ["draft pick: probabilistic"] * drafts
    assert {h.runner for h in chosen} == {None, version}
    hooks.uninstall()
    hooks.install(True, env, runner)  # brings in every vLLM module a hook touches
    hooks.uninstall()
    assert _commfold_wrappers() == []
    before = _namespaces()
    for hook in chosen:
        assert hook.install(env, runner) is True, hook.label()
        after = _namespaces()
        changed = sorted(f"{w}.{n}" for (w, n), v in after.items() if before.get((w, n)) is not v)
        assert bool(changed) == hook.wraps, f"{hook.label()} wrapped {changed}"
        hook.uninstall()
        assert _namespaces() == before, hook.label()
    hooks.install(True, env, runner)  # all together, as the plugin does
    assert _commfold_wrappers()
    hooks.uninstall()
    assert _namespaces() == before
    assert _commfold_wrappers() == []


@needs_v1
def test_a_hook_under_another_is_not_undone_first(env):
    """Undoing a hook whose wrapper another hook wrapped would drop that one too: it
    is refused with a line saying what to undo first."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from commfold.vllm.compat import hooks
    from commfold.vllm.observe import step_log
    from commfold.vllm.target import target_pick
    from commfold.vllm.compat.hook_points import wrapped_by

    hooks.uninstall()
    try:
        assert target_pick.install(env, RUNNERS[1])
        assert step_log.install(env, RUNNERS[1])
        assert wrapped_by(GPUModelRunner.execute_model) == ["step log", target_pick.KEY]
        with pytest.raises(RuntimeError, match="undo step log first"):
            target_pick.uninstall()
    finally:
        step_log.uninstall()
        target_pick.uninstall()
    assert wrapped_by(GPUModelRunner.execute_model) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_points_are_what_doctor_reports(version, env, monkeypatch):
    """The doctor's table (the plugin's load-time states) checks exactly the points
    each hook of the registry declares (the compat matrix's rows:
    tests/test_vllm_compat_tool.py)."""
    from commfold.vllm.compat import hook_points, hooks
    from commfold.vllm.observe.doctor import report

    checked = []
    real = hook_points.missing

    def missing(points):
        checked.append(tuple(points))
        return real(points)

    monkeypatch.setattr(hook_points, "missing", missing)
    lines = report(dict(env, VLLM_USE_V2_MODEL_RUNNER=str(version - 1)))
    chosen = hooks.of(RUNNERS[version])
    for hook in chosen:
        assert any(line.startswith(f"{hook.name} ") and " on " in line for line in lines), \
            (hook.name, lines)
        if hook.runner is not None:  # the graph passes hook checks nothing at load
            assert hook.points in checked, hook.label()
    assert all(any(p == h.points for h in chosen) for p in checked), checked


def test_one_pause_for_every_target_pick():
    """commfold.vllm.target.switch stops the V1 pick, both V2 sets and V2's prompt logprobs."""
    from commfold.vllm.target import switch as pause, target_pick_v2, v1_picker
    from commfold.vllm.target.target_pick_state import StatePick

    was = pause.pause(True)
    try:
        assert pause.paused()
        assert v1_picker.Picker._decide(SimpleNamespace()) == (None, "paused")
        assert target_pick_v2.decide(SimpleNamespace(), SimpleNamespace(), None) == \
            (None, "paused")
        state = StatePick(SimpleNamespace(), None, None, None)
        state.decide(batch := SimpleNamespace())
        assert (state.decided.batch, state.decided.mode, state.decided.why) == \
            (batch, None, "paused")
    finally:
        pause.pause(was)
    assert pause.paused() is was


def _vllm_modules() -> dict[str, Path]:
    """Every module of commfold.vllm, sub-packages included: dotted name -> file."""
    package = ROOT / "commfold" / "vllm"
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = ["commfold", "vllm", *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _private_reads(name: str, path: Path, ours: set[str]) -> list[str]:
    """`module._name` reads and `from module import _name` imports of our modules in one
    module (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name in ours}
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            up = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(up + ([node.module] if node.module else []))
        for a in node.names:
            if f"{base}.{a.name}" in ours:
                aliases.add(a.asname or a.name)
            elif base in ours and a.name.startswith("_"):
                found.append(f"{path.name}: from {base} import {a.name}")
    found += [f"{path.name}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in aliases and node.attr.startswith("_")
              and not node.attr.startswith("__")]
    return found


def test_no_hook_module_reads_anothers_private_names():
    """A hook module uses only what another one makes public (no `module._name`), in
    every sub-package of commfold.vllm."""
    import pkgutil

    import commfold.vllm

    modules = _vllm_modules()
    # as many as the import system finds: a walk that misses a sub-package checks less
    walked = {m.name for m in pkgutil.walk_packages(commfold.vllm.__path__, "commfold.vllm.")}
    assert set(modules) == walked | {"commfold.vllm"}
    assert {"commfold.vllm.plugin", "commfold.vllm.target.target_pick",
            "commfold.vllm.spec_decode.draft", "commfold.vllm.compat.hooks"} <= set(modules)
    ours = set(modules)
    found = [f for name, path in modules.items() for f in _private_reads(name, path, ours)]
    assert found == []


def test_private_reads_are_found_through_every_import_spelling(tmp_path):
    ours = {"commfold.vllm.target", "commfold.vllm.target.switch",
            "commfold.vllm.target.picker", "commfold.vllm.compat.runtime"}
    path = tmp_path / "picker.py"
    path.write_text("from commfold.vllm.target import switch as s\n"
                    "from . import switch\n"
                    "from ..compat import runtime\n"
                    "import commfold.vllm.compat.runtime as rt\n"
                    "from commfold.vllm.compat.runtime import _gate, gate\n"
                    "s._on, switch._on, runtime._x, rt._y, s.__doc__, s.on\n")
    assert _private_reads("commfold.vllm.target.picker", path, ours) == [
        "picker.py: from commfold.vllm.compat.runtime import _gate",
        "picker.py: s._on", "picker.py: switch._on", "picker.py: runtime._x",
        "picker.py: rt._y"]


# --- the V1 target pick runs vLLM's own _sample ---------------------------------------

V = 1500


def _v1_sample(shm: bool, cases: list[dict]) -> list[dict]:
    """One step per case through the hooked _sample (vLLM's own body, its samplers
    answering the shard) and through vLLM's _sample on the gathered logits."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from commfold.distributed.ranks import environment
    from commfold.vllm.target import target_pick, v1_picker
    from harness import vllm_step as tc

    current_platform.register_triton_kernel_overrides()
    init_vllm_tp(2, shm=shm, reuse=True)
    vllms = inspect.unwrap(GPUModelRunner.__dict__["_sample"])
    hooked = target_pick._sample(vllms)
    out = []
    for case in cases:
        model = tc.TinyLM(V, torch.float32, case["seed"], ties=True)
        drafts = case.get("drafts")
        spec = tc.spec_metadata(drafts) if drafts else None
        rows = spec.logits_indices.numel() if spec is not None else case["rows"]
        h = tc.hidden(rows, torch.float32, case["seed"] + 1, ties=True)
        r = tc.runner(model, tc.metadata(len(drafts or []) or rows, case.get("k"), V))
        calls: list[str] = []  # what vLLM's _sample does besides sampling
        r.input_batch.update_async_output_token_ids = lambda calls=calls: calls.append("ids")
        r.use_async_scheduling, r._draft_token_req_ids = False, None
        r._get_spec_decode_draft_probs = lambda meta, calls=calls: calls.append("draft probs")
        picker = v1_picker.Picker.build(r)
        r._commfold_picker = picker
        picker.scheduler_output = SimpleNamespace(
            scheduled_spec_decode_tokens={"a": [0]} if spec is not None else {},
            has_structured_output_requests=False)
        samplers = (r.sampler, r.rejection_sampler)
        with environment({"COMMFOLD_PICK_COST_RULE": "0"}):
            picker.in_execute = True
            shard = model.compute_logits(h)
            mode = picker.pending.mode if picker.pending is not None else None
            ours = hooked(r, shard, spec)
        ours_calls, calls[:] = list(calls), []
        theirs = vllms(r, model.compute_logits(h), spec)
        lp = [(o.logprob_token_ids.tolist(), o.selected_token_ranks.tolist())
              for o in (ours.logprobs_tensors, theirs.logprobs_tensors) if o is not None]
        out.append(dict(mode=mode, shard=shard.shape[-1], calls=(ours_calls, calls),
                        tokens=torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids),
                        logprobs=len(lp) != 1 and (not lp or lp[0] == lp[1]),
                        restored=all(a is b for a, b in zip(
                            (r.sampler, r.rejection_sampler), samplers)),
                        pending=picker.pending is None))
    return out


@needs_v1
def test_v1_target_pick_runs_vllms_own_sample(vllm_ranks):
    cases = [dict(seed=1, rows=5, mode="greedy"), dict(seed=2, rows=4, k=3, mode="logprobs"),
             dict(seed=3, drafts=[[1, 2], [3]], mode="verify")]
    for res in vllm_ranks.run(_v1_sample, shm_supported(), cases):
        for case, r in zip(cases, res):
            assert r["mode"] == case["mode"] and r["shard"] < V, (case, r)
            assert r["tokens"] and r["logprobs"] and r["restored"] and r["pending"], (case, r)
            want = ["ids", "draft probs"] if case.get("drafts") else ["ids"]
            assert r["calls"] == (want, want), (case, r)
