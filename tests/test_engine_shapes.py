"""The real-shape engine benchmark's bookkeeping (benchmarks/engine_shapes.py), with
its engines replaced by a recorded timing table: several timed runs per row per round
reduce to their median, rounds keep their order, the ratios to vLLM are per round and
the table says how many runs each round took. Engines themselves run only in the
benchmark (minutes each)."""
from __future__ import annotations

import statistics

import pytest

from benchmarks import engine_shapes

# seconds per (engine variant, round, traffic/C) for 3 runs each
SECONDS = {
    ("vllm", 0): [1.0, 1.2, 0.9], ("vllm", 1): [2.0, 1.1, 1.0],
    ("commfold", 0): [0.8, 0.7, 0.9], ("commfold", 1): [0.9, 1.0, 3.0],
    (engine_shapes.NO_PICK, 0): [1.0, 1.0, 1.0], (engine_shapes.NO_PICK, 1): [1.1, 1.2, 1.0],
}


class _Llm:
    """Stands in for an engine: each generate() returns the next recorded time."""

    def __init__(self):
        self.variant, self.round, self.i = None, None, 0


def _fake_generate(llm, batch, tokens, traffic):
    secs = SECONDS[(llm.variant, llm.round)][llm.i % 3]
    llm.i += 1
    return {"seconds": secs, "output_tokens": tokens * len(batch),
            "tokens": [[7] * tokens for _ in batch]}


@pytest.fixture
def fake_engines(monkeypatch):
    def one_engine(model, engine_variant, concurrency, tokens, warmup, r, runs=1):
        names = [engine_variant] if engine_variant == "vllm" else [
            "commfold", engine_shapes.NO_PICK]
        out = {}
        for v in names:
            llm = _Llm()
            llm.variant, llm.round = v, r
            out[v] = {f"{t}/{c}": engine_shapes.timed(llm, [[1]] * c, tokens, t, runs)
                      for t in engine_shapes.TRAFFIC for c in concurrency}
        return {"runs": out, "start_s": 1.0}

    monkeypatch.setattr(engine_shapes, "one_engine", one_engine)
    monkeypatch.setattr(engine_shapes, "generate", _fake_generate)
    monkeypatch.setattr(engine_shapes, "write_shape", lambda *a, **k: None)


def test_rounds_take_the_median_of_their_runs(fake_engines):
    r = engine_shapes.run("qwen3-1.7b", 4, [1], tokens=8, rounds=2, log=lambda s: None,
                          runs=3)
    row = {x["variant"]: x for x in r["rows"]
           if x["traffic"] == "greedy" and x["concurrency"] == 1}
    med = {k: statistics.median(v) for k, v in SECONDS.items()}
    assert row["vllm"]["seconds"] == [med[("vllm", 0)], med[("vllm", 1)]]
    assert row["commfold"]["seconds"] == [med[("commfold", 0)], med[("commfold", 1)]]
    assert row["commfold"]["vs_vllm_each"] == pytest.approx(
        [med[("vllm", i)] / med[("commfold", i)] for i in range(2)])
    assert row["commfold"]["same_tokens"] is True


def test_runs_disagreeing_on_tokens_stop_the_benchmark(monkeypatch):
    answers = iter([[[1, 2]], [[1, 3]]])
    monkeypatch.setattr(engine_shapes, "generate", lambda *a: {
        "seconds": 1.0, "output_tokens": 2, "tokens": next(answers)})
    with pytest.raises(AssertionError, match="disagree"):
        engine_shapes.timed(None, [[1]], 2, "greedy", 2)


def test_the_table_says_how_many_runs_a_round_took(fake_engines):
    r = engine_shapes.run("qwen3-1.7b", 4, [1, 8], tokens=8, rounds=2, log=lambda s: None,
                          runs=3)
    r.update(layers=4, full_layers=28, date="d", config="c", command="x", tokens=8,
             prompt_len=16, runs_per_round=3)
    md = engine_shapes.markdown({"shapes": {"qwen3-1.7b": r}})
    assert "3 timed run(s) per row per round, their median" in md
    assert md.count("| greedy | 8 |") == 3  # vllm, commfold, pick paused
