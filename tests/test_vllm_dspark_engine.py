"""vLLM's DSpark speculative decoding on its engine, Model Runner V2's CPU runner (the
V2 recipe of harness.triton_cpu), TP=2: a Qwen3 target and a ``Qwen3DSparkModel``
draft (harness/vllm_dspark.py), greedy, the draft's Markov head as vLLM ships it
(replicated) and built sharded (as before vLLM's hand edit; harness/dspark_sharded.py),
commfold off and then on through the plugin (COMMFOLD_VLLM=1): the same tokens and
the same drafts accepted in every run; commfold says on each worker that it
replicated the sharded head, and its per-position collectives (an all-reduce of the
Markov embedding, a vocab gather of its bias) are gone; the block's base draft logits
are picked from each rank's shard (commfold.vllm.spec_decode.dspark_pick): no full-vocab gather
in the drafting phase, one (value, index) exchange per position, noted per step.

Opt-in (three engines, ~2.5 minutes on 2 cores): `slow`, run with
`python -m pytest -m slow tests/test_vllm_dspark_engine.py`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.vllm_models import TOKENS_MARK, engine_env, require_vllm_installed

pytestmark = [*require_vllm_installed(group="module"), pytest.mark.engine, pytest.mark.slow]

from commfold.distributed.comm_log import read_step_logs  # noqa: E402
from harness.vllm_dspark import K, RANK  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"shipped": ("", ""), "off": ("", "1"), "on": ("1", "1")}  # COMMFOLD_VLLM, sharded
REPLICATED = ("Qwen3DSparkForCausalLM's Markov head is sharded: replicated markov_w1 "
              "(128000 B), markov_w2 (128000 B); kept sharded none")


@pytest.fixture(scope="module")
def dspark_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dspark")
    env = engine_env(tmp, v2=True)
    # the cost rule off: the tiny vocab's block would keep vLLM's gather (commfold.cost)
    runs = [{"COMMFOLD_VLLM": on, "HARNESS_DSPARK_SHARDED": sharded,
             "COMMFOLD_COMM_LOG_DIR": str(tmp / f"log-{name}"),
             "COMMFOLD_PICK_COST_RULE": "0"}
            for name, (on, sharded) in RUNS.items()]
    proc = subprocess.run([sys.executable, "-m", "harness.vllm_dspark", str(tmp),
                           json.dumps(runs)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(TOKENS_MARK)]
    out = dict(zip(RUNS, json.loads(line[len(TOKENS_MARK):])))
    printed = (proc.stdout + proc.stderr).splitlines()  # through vLLM's log handlers
    return dict(out=out, lines=[x for x in printed if "Markov head" in x],
                steps={n: read_step_logs(tmp / f"log-{n}") for n in RUNS})


def test_dspark_tokens_and_drafts_identical(dspark_runs):
    out = dspark_runs["out"]
    assert all(len(t) == 12 for t in out["shipped"]["tokens"])
    for name in ("off", "on"):
        assert out[name]["tokens"] == out["shipped"]["tokens"], name
        # the drafts follow the Markov head (harness/vllm_dspark.py): equal counters,
        # most of them accepted, are the same drafts
        assert out[name]["spec"] == out["shipped"]["spec"], name
    spec = out["on"]["spec"]
    assert spec["num_accepted_tokens"] >= 0.8 * spec["num_draft_tokens"] > 0, spec


def test_dspark_sharded_head_replicated_on_each_worker(dspark_runs):
    """One line per worker, printed as vLLM prints its own; the shipped head: none
    (commfold is off in that run)."""
    lines = dspark_runs["lines"]
    assert [line.split("commfold: ", 1)[1] for line in lines] == [REPLICATED] * 2, lines
    for worker in ("(Worker_TP0 ", "(Worker_TP1 "):
        assert sum(line.startswith(worker) for line in lines) == 1, lines


def test_dspark_markov_collectives_gone(dspark_runs):
    def markov(by_rank):  # per rank: collectives of Markov-embedding rows in token steps
        return {rank: [e for s in steps if s.info["tokens"] and s.step > 0 for e in s.events
                       if any(len(x) == 2 and x[1] == RANK for x in e.shapes)]
                for rank, steps in by_rank.items()}

    steps = dspark_runs["steps"]
    for name in RUNS:
        assert sorted(steps[name]) == [0, 1], name
        r0, r1 = steps[name][0], steps[name][1]
        assert [s.events for s in r0] == [s.events for s in r1], name
    off, on, shipped = (markov(steps[n]) for n in ("off", "on", "shipped"))
    assert off[0] and {e.name for e in off[0]} == {"all_reduce"}, off[0]  # one per position
    assert on == shipped == {0: [], 1: []}, (on, shipped)
    # the bias's vocab gathers (a LogitsProcessor call: phase "logits"), one per position;
    # with commfold the block's base-logits gather is gone too (its calls: "drafting")
    gathers = {n: sum(s.in_phase("logits").calls("all_gather") for s in steps[n][0] if s.step)
               for n in RUNS}
    blocks = sum(1 for s in steps["on"][0] if s.step and s.info.get("draft_pick"))
    assert blocks > 0
    assert gathers["off"] - len(off[0]) == gathers["shipped"] == gathers["on"] + blocks, gathers


def test_dspark_block_picks_without_its_gather(dspark_runs):
    """Each drafting step of the "on" run: commfold's block pick (its note), K pair
    exchanges ([requests, 4] f32 words on vLLM's shared memory, [requests, 2] int64 on
    gloo) and nothing vocab-wide."""
    for rank, by_step in dspark_runs["steps"]["on"].items():
        drafting = [s for s in by_step if s.step and s.info.get("draft_pick")]
        assert drafting, rank
        for s in drafting:
            assert s.info["draft_pick"] == f"commfold ({K} pair exchanges)", s.info
            events = s.in_phase("drafting").events
            assert [e.name for e in events] == ["all_gather"] * K, events
            assert all(len(e.shapes[0]) == 2 and e.shapes[0][1] in (2, 4) for e in events), events
