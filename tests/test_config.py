"""The pass registry and the typed options, without ranks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import commfold
from commfold.config import unknown_passes
from commfold.passes import PASSES
from commfold.vllm.plugin import EnvError, VllmCommfoldPass

ROOT = Path(__file__).resolve().parent.parent


def test_every_pass_module_is_registered_once_in_order():
    # a module whose name starts with "_" holds pieces passes share, not a pass
    modules = {p.stem for p in (ROOT / "passes").glob("*.py") if not p.stem.startswith("_")}
    assert set(commfold.ALL_PASSES) == modules  # a pass module nobody runs, or a name
    assert commfold.ALL_PASSES == tuple(PASSES) == commfold.Config().passes  # without one
    assert all(PASSES[name].__module__ == f"commfold.passes.{name}" for name in PASSES)
    assert unknown_passes(["local_argmax", "bogus"]) == ["bogus"]


def test_two_shot_threshold_is_a_field_in_the_cache_key():
    default, forced = commfold.Config(), commfold.Config(two_shot_min_bytes=0)
    assert default.two_shot_min_bytes == -1  # off: measured slower on gloo
    assert default.key() != forced.key()
    assert commfold.CommfoldPass(default).uuid() != commfold.CommfoldPass(forced).uuid()
    assert commfold.backend(two_shot_min_bytes=4096).config.two_shot_min_bytes == 4096
    with pytest.raises(ValueError, match="two_shot_min_bytes"):
        commfold.Config(two_shot_min_bytes=-2)


def test_vllm_pass_reads_the_environment_at_first_use(monkeypatch):
    """vLLM resolves "commfold.vllm_pass" from commfold's __dict__: the import must not
    fail on a bad COMMFOLD_* value; the first use says in one line what to set."""
    code = ("import commfold; p = commfold.__dict__['vllm_pass']; print('imported', flush=True);"
            " p.uuid()")
    env = {**os.environ, "COMMFOLD_PASSES": "local_argmax,bogus"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout.strip() == "imported" and proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("commfold.vllm.graph_passes.EnvError: commfold: COMMFOLD_PASSES=")
    assert "['bogus']" in last and "local_argmax" in last

    monkeypatch.setenv("COMMFOLD_PASSES", "local_argmax")
    monkeypatch.setenv("COMMFOLD_REPLICATE_MAX_BYTES", "1 MiB")
    lazy = VllmCommfoldPass()  # reads nothing yet
    with pytest.raises(EnvError, match=r"COMMFOLD_REPLICATE_MAX_BYTES='1 MiB' is not a byte"):
        lazy.uuid()
    monkeypatch.setenv("COMMFOLD_REPLICATE_MAX_BYTES", "1024")
    assert lazy.config == commfold.Config(passes=("local_argmax",), replicate_max_bytes=1024)
    assert VllmCommfoldPass(commfold.Config()).config == commfold.Config()  # given: no env


def test_head_limit_is_a_field_in_the_cache_key_and_an_environment_variable(monkeypatch):
    measured, set_ = commfold.Config(), commfold.Config(replicate_head_max_bytes=1 << 20)
    assert measured.replicate_head_max_bytes is None and measured.key() != set_.key()
    assert commfold.CommfoldPass(measured).uuid() != commfold.CommfoldPass(set_).uuid()
    with pytest.raises(ValueError, match="replicate_head_max_bytes must be >= 0 or None"):
        commfold.Config(replicate_head_max_bytes=-1)
    monkeypatch.setenv("COMMFOLD_REPLICATE_HEAD_MAX_BYTES", str(1 << 20))
    assert VllmCommfoldPass().config == set_
    monkeypatch.setenv("COMMFOLD_REPLICATE_HEAD_MAX_BYTES", "16MiB")
    with pytest.raises(EnvError, match=r"COMMFOLD_REPLICATE_HEAD_MAX_BYTES='16MiB' is not a "
                                       r"byte count.*measured per device"):
        VllmCommfoldPass().uuid()


def test_cost_rule_is_a_field_in_the_cache_key_and_an_environment_switch(monkeypatch):
    on, off = commfold.Config(), commfold.Config(fuse_cost_rule=False)
    assert on.fuse_cost_rule and on.key() != off.key()
    assert commfold.CommfoldPass(on).uuid() != commfold.CommfoldPass(off).uuid()
    monkeypatch.setenv("COMMFOLD_FUSE_COST_RULE", "0")
    assert VllmCommfoldPass().config == off
    monkeypatch.setenv("COMMFOLD_FUSE_COST_RULE", "off")
    with pytest.raises(EnvError, match=r"COMMFOLD_FUSE_COST_RULE='off': set it to 0"):
        VllmCommfoldPass().uuid()
