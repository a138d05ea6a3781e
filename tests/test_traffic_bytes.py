"""benchmarks/bench_traffic_bytes.py's reading of the step log and its formulas
(benchmarks/traffic_formulas.py), on step logs written here: a call's decode steps
and the pick's bytes (forward passes and the drafter's all-reduces left out), a log
split into its planned calls when the engines did not finish, and the formulas at
sizes worked out by hand."""
from __future__ import annotations

from benchmarks import bench_traffic_bytes as bench
from benchmarks import traffic_formulas as tf
from commfold.distributed.comm_log import CommEvent, StepLog


def _step(tokens: int, requests: int, events=()) -> StepLog:
    return StepLog(list(events), info={"tokens": tokens, "requests": requests})


GATHER = CommEvent("all_gather", ((8, 75968),), "c10::BFloat16", "sampling")
FORWARD = CommEvent("all_reduce", ((8, 128),), "c10::BFloat16", "forward")
DRAFTER = CommEvent("all_reduce", ((8, 128),), "c10::BFloat16", "other")
PAIR = CommEvent("all_gather", ((8, 4),), "float", "other")


def test_a_calls_decode_steps_and_the_picks_bytes():
    steps = [_step(48, 8, [FORWARD, GATHER]), _step(8, 8, [FORWARD, GATHER, DRAFTER, PAIR]),
             _step(8, 8, [FORWARD, GATHER]), _step(7, 7, [GATHER]), _step(0, 0)]
    call = {"kind": "greedy", "c": 8, "lines": [0, 5]}
    got = bench.call_figures(call, {0: steps, 1: steps})
    assert got["steps"] == 2  # the prefill and the 7-request step are not decode steps
    assert (got["min"], got["max"]) == (1_215_488, 1_215_488 + 128)
    assert got["forward_bytes"] == 8 * 128 * 2


def test_a_log_splits_into_its_finished_calls():
    steps = [_step(t, 1) for t in (6, 1, 1, 0, 0, 6, 1, 1, 0, 6, 1)]
    planned = [{"kind": "greedy", "c": 1}, {"kind": "chat-top-p", "c": 1},
               {"kind": "chat+logprobs", "c": 1}]
    calls = bench.split_calls(steps, planned)
    assert [(c["kind"], c["lines"]) for c in calls] == [("greedy", [0, 3]),
                                                       ("chat-top-p", [5, 8])]


def test_the_formulas_at_hand_worked_sizes():
    assert tf.shard(151936, 2) == 75968 and tf.shard(128256, 8) == 16032
    assert tf.gather(151936, 8, 2) == 8 * 75968 * 2
    parts = tf.batch_sharded(151936, 8, 2, logprobs=5)
    # all rows' shards; 4 requests per rank x (1 token + 2) int64; ids 7 int64 + 6 f32
    assert parts == {"all_to_all": 8 * 75968 * 2, "output_gather": 4 * 3 * 8,
                     "logprobs_gathers": 4 * (7 * 8 + 6 * 4)}
    assert tf.batch_sharded_to_others(151936, 8, 2) == 4 * 75968 * 2 + 4 * 3 * 8
    assert tf.ours_greedy(8) == 128 and tf.ours_logprobs(1, 5) == 40 + 48
    # spec: two drafts of 8 requests gathered by vLLM besides the 24 target rows
    assert tf.vllm_spec(151936, 8, 2, 2) == (24 + 16) * 75968 * 2
    assert 0 < tf.ours_spec(151936, 8, 2, 2, True) < tf.vllm_spec(151936, 8, 2, 2) // 20


def test_computed_rows_mark_their_source():
    """Without a log: every cell computed, but the logprobs rounds (their width is the
    data's) left open; a sampled step's exchanges by formula (min_p's float32 maximum,
    the top-p bounds' 4152 bytes at this shard, the draw's int64 triple)."""
    rows = bench.rows({}, concurrency=(8,), worlds=(2,))
    assert {r["gather_source"] for r in rows} == {bench.COMPUTED}
    qwen = {r["kind"]: r for r in rows if r["shape"] == "qwen3-1.7b"}
    assert qwen["chat-top-p"]["commfold"] == 8 * (4 + 4152 + 24)
    assert qwen["chat-top-p"]["commfold_source"] == bench.COMPUTED
    for kind in ("greedy+logprobs", "chat+logprobs"):
        assert qwen[kind]["commfold"] is None and qwen[kind]["commfold_source"] == "n/a"
