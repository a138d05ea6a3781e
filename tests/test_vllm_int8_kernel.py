"""vLLM CPU's int8 W8A8 linear, the kernel the int8 engine pair runs
(tests/test_vllm_int8_engine.py), against the same integer arithmetic done exactly
(harness.int8_kernel, each run in its own process: vLLM loads one kernel build a process).

- This CPU's build: the per-token-quantized input times the int8 weight, scaled, within
  bf16 rounding of the exact result, on oneDNN's int8 GEMM (no AMX here: vLLM's AMX
  kernel needs it). Skipped, with the reason, on a CPU without VNNI, where oneDNN's
  int8 GEMM saturates (below).
- vLLM's AVX2 build with oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2: an AVX2 CPU
  without VNNI, Haswell to Zen 3, as vLLM and oneDNN see it): the int8 kernel exists
  and runs (so no int8 test is skipped for AVX2 as such), and oneDNN takes its
  pre-VNNI ``gemm:jit``, which saturates as 16-bit sums of u8 x s8 pairs (vpmaddubsw)
  would: full-range weights (|w| up to 127, as every symmetric
  per-channel checkpoint has) come out far off, 7-bit weights exact. That is vLLM's
  output on such a CPU, with or without commfold (the engine pair compares the two, so
  it holds there too). Should oneDNN or vLLM change this, the test fails: update
  docs/vllm.md.

~10 CPU-seconds a process (vLLM's import), two processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.int8_kernel import MARK, matmul_impls
from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed()

ROOT = Path(__file__).resolve().parents[1]


def _run(build: str, isa: str | None = None) -> tuple[dict, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEDNN_")}
    env.update(ONEDNN_VERBOSE="1", **({"ONEDNN_MAX_CPU_ISA": isa} if isa else {}))
    proc = subprocess.run([sys.executable, "-m", "harness.int8_kernel", build], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
    return json.loads(line[len(MARK):]), matmul_impls(proc.stdout)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags")
            for f in line.split(":", 1)[1].split()}


def _within_bf16(err: float, scale: float) -> bool:
    return err <= 2 * 2.0**-8 * scale  # two bf16 ulps of the largest output


def test_int8_linear_exact_on_this_cpu():
    flags = _cpu_flags()
    if not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        pytest.skip("this CPU has no VNNI: oneDNN's int8 GEMM saturates 16-bit pair sums "
                    "of full-range int8 weights (see test_avx2_build_without_vnni)")
    out, impls = _run("native")
    assert out["path"] in ("_apply_weights_onednn", "_apply_weights_sgl"), out
    if out["path"] == "_apply_weights_onednn":
        assert impls and all("vnni" in i or "amx" in i for i in impls), impls
    assert _within_bf16(*out["full_range"]) and _within_bf16(*out["seven_bit"]), out


def test_avx2_build_without_vnni():
    out, impls = _run("avx2", "AVX2")
    assert out["build"] == ["_C_AVX2.abi3.so"] and out["path"] == "_apply_weights_onednn"
    assert impls == ["gemm:jit"], impls
    assert _within_bf16(*out["seven_bit"]), out  # no pair sum reaches 2**15
    err, scale = out["full_range"]
    assert err > 0.05 * scale, out  # saturated: off by 15% of the largest output here
