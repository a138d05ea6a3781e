"""commfold's registration with vLLM, without starting an engine: the pass named in
compilation_config, the general plugin (COMMFOLD_VLLM=1), and cache keys that change
with commfold's code and config (vLLM's config hash / AOT compile key, Inductor's FX
graph cache). Each check that depends on import order runs in a fresh interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed()

import commfold  # noqa: E402
from commfold import Config  # noqa: E402
from commfold.vllm.plugin import PASS_KEY, VllmCommfoldPass  # noqa: E402


def _start(code: str, **env) -> subprocess.Popen:
    """code in a fresh interpreter (started, not awaited); it prints one JSON line last."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("COMMFOLD_")}
    full_env.update(env)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


_ROUTES = """
    import json, sys
    {first}
    # what an import of commfold alone (when first) brought in: no vLLM
    alone = {{"vllm": sorted(m for m in sys.modules if m.split(".")[0] == "vllm"),
             "pass": type(sys.modules["commfold"].__dict__["vllm_pass"]).__name__}} \
        if "commfold" in sys.modules else None
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.compilation.passes.inductor_pass import CallableInductorPass
    from vllm.plugins import load_general_plugins
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from commfold.vllm.compat.hook_points import wrapped_by
    KEY = "post_grad_custom_post_pass"
    # route 1: the pass named in compilation_config
    cc = CompilationConfig(inductor_passes={{KEY: "commfold.vllm_pass"}})
    at_config = type(cc.inductor_compile_config[KEY]).__name__
    load_general_plugins()  # as EngineArgs does before it builds the VllmConfig
    from vllm.ray.ray_env import get_env_vars_to_copy  # what Ray workers are given
    ray_copies = sorted(v for v in get_env_vars_to_copy() if v.startswith("COMMFOLD_"))
    p = VllmConfig(compilation_config=cc).compilation_config.inductor_compile_config[KEY]
    import commfold
    # route 2: the plugin alone (COMMFOLD_VLLM), with and without a user's own pass
    plain = VllmConfig().compilation_config.inductor_compile_config.get(KEY)
    def user_pass(graph):
        pass
    cc = CompilationConfig(inductor_compile_config={{KEY: CallableInductorPass(user_pass, "u1")}})
    u = VllmConfig(compilation_config=cc).compilation_config.inductor_compile_config[KEY]
    print(json.dumps({{
        "commfold_alone": alone,
        "named": [at_config, type(p).__name__, p.uuid() == commfold.vllm_pass.uuid(),
                  list(p.config.passes)],
        "plugin": [type(plain).__name__, type(u).__name__,
                   getattr(getattr(getattr(u, "then", None), "callable", None), "__name__", None),
                   list(getattr(getattr(u, "config", None), "passes", []))],
        "drafter_hook": [wrapped_by(SpecDecodeBaseProposer._get_model),
                         wrapped_by(SpecDecodeBaseProposer._greedy_sample)],
        "ray_copies": ray_copies}}))
"""


@pytest.fixture(scope="module")
def routes() -> dict:
    """_ROUTES in two fresh interpreters, started together (each imports vLLM):
    vLLM imported first with the plugin off; commfold imported first, plugin on.
    What commfold's import alone brought in is kept apart, under "alone"."""
    procs = {"vllm_first": _start(_ROUTES.format(first="")),
             "commfold_first": _start(_ROUTES.format(first="import commfold"),
                                      COMMFOLD_VLLM="1", COMMFOLD_PASSES="local_argmax")}
    found = {name: _result(proc) for name, proc in procs.items()}
    found["alone"] = {name: res.pop("commfold_alone") for name, res in found.items()}
    return found


def test_import_commfold_does_not_import_vllm(routes):
    """Checked in the interpreter that imports commfold first, before it imports vLLM
    (COMMFOLD_VLLM=1 there: the plugin's switch alone imports nothing either)."""
    assert routes["alone"] == {"commfold_first": {"vllm": [], "pass": "VllmCommfoldPass"},
                               "vllm_first": None}


def test_named_pass_in_either_import_order_and_plugin_off(routes):
    """vLLM keeps commfold's pass as its own InductorPass (so its uuid keys the
    caches) when vLLM imports commfold to resolve the name; without COMMFOLD_VLLM the
    plugin adds nothing."""
    assert routes["vllm_first"] == {
        "named": ["VllmCommfoldPass", "VllmCommfoldPass", True, list(commfold.ALL_PASSES)],
        "plugin": ["NoneType", "CallableInductorPass", None, []],
        "drafter_hook": [[], []], "ray_copies": []}


def test_commfold_imported_first_and_plugin_on(routes):
    """commfold imported before vLLM: vLLM wraps the named pass, the plugin unwraps it.
    COMMFOLD_VLLM=1 adds the pass (options from COMMFOLD_PASSES), after a user's own
    post-grad pass is kept (runs after commfold's), and hooks draft-model loading and
    the draft pick. vLLM's Ray executor would give its workers the COMMFOLD_ settings
    (its env-copy list, extended by the plugin: vLLM copies VLLM_*, NCCL_*, ... only)."""
    assert routes["commfold_first"] == {
        "named": ["CallableInductorPass", "VllmCommfoldPass", True, ["local_argmax"]],
        "plugin": ["VllmCommfoldPass", "VllmCommfoldPass", "user_pass", ["local_argmax"]],
        "drafter_hook": [["draft get_top_tokens", "draft pick"], ["draft pick"]],
        "ray_copies": ["COMMFOLD_PASSES", "COMMFOLD_VLLM"]}


def _vllm_keys(pass_):
    """vLLM's compile-cache factors (config hash, AOT key) for a config with pass_."""
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.config import CompilationConfig, VllmConfig

    passes = {PASS_KEY: pass_} if pass_ is not None else {}
    vc = VllmConfig(compilation_config=CompilationConfig(inductor_compile_config=passes))
    return vc.compute_hash(), tuple(aot_compile_hash_factors(vc))


def test_vllm_cache_key_follows_commfold_code_and_config(monkeypatch):
    import commfold.manager as manager

    base = _vllm_keys(VllmCommfoldPass(Config()))
    assert _vllm_keys(VllmCommfoldPass(Config())) == base  # stable
    assert _vllm_keys(commfold.vllm_pass) == base  # the named pass, default env
    other_config = _vllm_keys(VllmCommfoldPass(Config(passes=("local_argmax",))))
    other_threshold = _vllm_keys(VllmCommfoldPass(Config(replicate_max_bytes=1)))
    without = _vllm_keys(None)
    monkeypatch.setattr(manager, "code_hash", lambda: "another commfold version")
    other_code = _vllm_keys(VllmCommfoldPass(Config()))
    keys = [base, other_config, other_threshold, without, other_code]
    for i in range(len(keys)):  # config hash and AOT key both differ pairwise
        for j in range(i):
            assert keys[i][0] != keys[j][0] and keys[i][1] != keys[j][1], (i, j)


def _add_one(x):
    return torch.nn.functional.relu(x) + 1


def test_inductor_fx_cache_follows_commfold_config(tmp_path, monkeypatch):
    """A graph compiled under one commfold config is not served under another; the
    same config is served from the cache (the key is stable)."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(8)

    def compile_with(pass_):
        torch._dynamo.reset()
        counters.clear()
        with inductor_config.patch(post_grad_custom_post_pass=pass_, fx_graph_cache=True,
                                   fx_graph_remote_cache=False):
            out = torch.compile(_add_one, backend="inductor")(x)
        assert torch.equal(out, _add_one(x))
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    a = VllmCommfoldPass(Config())
    assert compile_with(a) == (0, 1)
    assert compile_with(VllmCommfoldPass(Config())) == (1, 0)
    assert compile_with(VllmCommfoldPass(Config(passes=("local_argmax",)))) == (0, 1)
    monkeypatch.setattr("commfold.manager.code_hash", lambda: "another commfold version")
    assert compile_with(VllmCommfoldPass(Config())) == (0, 1)


def test_a_plain_commfold_pass_is_adopted_with_its_state():
    """A CommfoldPass object (not the vLLM subclass) put in vLLM's config keeps its
    config, chained pass and report hook, and gets vLLM's InductorPass interface."""
    from vllm.compilation.passes.inductor_pass import InductorPass
    from vllm.config import CompilationConfig, VllmConfig

    from commfold.vllm.compat import hooks
    from commfold.vllm.plugin import register

    register()
    try:
        seen = []
        mine = commfold.CommfoldPass(Config(passes=("local_argmax",)), on_report=seen.append)
        vc = VllmConfig(compilation_config=CompilationConfig(
            inductor_compile_config={PASS_KEY: mine}))
        adopted = vc.compilation_config.inductor_compile_config[PASS_KEY]
    finally:
        hooks.uninstall()
    assert isinstance(adopted, VllmCommfoldPass) and isinstance(adopted, InductorPass)
    assert adopted.config == mine.config and adopted.on_report == seen.append
    assert adopted.uuid() == mine.uuid() and adopted.is_applicable_for_range(None)


_LOG_LINES = """
    import json, logging
    {setup}
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    configure_logging(LoggingConfig())  # as an engine process does: the "vllm" logger
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # commfold's plugin: its hook lines
    logging.getLogger("commfold").info("commfold: a line at INFO")
    logging.info("a library's root-logger line")  # adds a root handler (basicConfig)
    logging.getLogger("commfold").info("commfold: a second line")
    print(json.dumps({{"handlers": len(logging.getLogger("commfold").handlers)}}))
"""


def test_plugin_lines_print_through_vllms_logging():
    """In a vLLM process commfold's INFO lines (hooks on or off, the drafter's head)
    print as vLLM's own do; an application that configured logging keeps its own."""
    plain = _start(_LOG_LINES.format(setup=""), COMMFOLD_VLLM="1")
    own = _start(_LOG_LINES.format(setup="logging.basicConfig(level=logging.WARNING)"),
                 COMMFOLD_VLLM="1")
    out, err = plain.communicate(timeout=300)
    assert plain.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"handlers": 1}
    printed = out + err
    assert "commfold: a line at INFO" in printed and "commfold: target pick on" in printed
    assert printed.count("commfold: a second line") == 1, printed[-2000:]
    out, err = own.communicate(timeout=300)
    assert own.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"handlers": 0}
    assert "commfold: a line at INFO" not in out + err
