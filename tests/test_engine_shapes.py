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


def test_paired_runs_rotate_and_compare_runs_seconds_apart(monkeypatch):
    """run_paired keeps both engines, times the three variants back to back per row
    (the order rotating by round) and pauses the pick only for the paused variant."""
    from contextlib import contextmanager

    calls: list[tuple[str, str, bool]] = []  # (engine, traffic/C, pick paused)

    class Engine:
        def __init__(self, name):
            self.name, self.paused, self.start_s = name, False, 1.0
            self.llm_engine = type("E", (), {"model_config": type(
                "M", (), {"get_vocab_size": staticmethod(lambda: 100)})()})()

        def collective_rpc(self, fn, args):
            self.paused = args[0]

    @contextmanager
    def open_engine(model, variant, concurrency, tokens):
        yield Engine(variant)

    def generate(llm, batch, tokens, traffic):
        calls.append((llm.name, f"{traffic}/{len(batch)}", llm.paused, tokens))
        secs = {"vllm": 2.0, "commfold": 1.0}[llm.name] * (1.5 if llm.paused else 1.0)
        return {"seconds": secs, "output_tokens": tokens * len(batch),
                "tokens": [[3] * tokens for _ in batch]}

    monkeypatch.setattr(engine_shapes, "open_engine", open_engine)
    monkeypatch.setattr(engine_shapes, "generate", generate)
    monkeypatch.setattr(engine_shapes, "write_shape", lambda *a, **k: None)
    monkeypatch.setattr(engine_shapes, "IDLE_S", 0)
    r = engine_shapes.run_paired("qwen3-1.7b", 4, [1, 8], tokens=8, rounds=3,
                                 log=lambda s: None, runs=1)
    timed_calls = [c for c in calls if c[3] == 8]
    # per round 2 traffic kinds x 2 C x 3 variants; the first variant rotates
    assert len(timed_calls) == 3 * 2 * 2 * 3
    firsts = [timed_calls[i * 12] for i in range(3)]
    assert [(e, p) for e, _, p, _ in firsts] == [
        ("vllm", False), ("commfold", False), ("commfold", True)]
    row = {x["variant"]: x for x in r["rows"]
           if x["traffic"] == "logprobs=5" and x["concurrency"] == 8}
    assert row["commfold"]["vs_vllm_each"] == [2.0, 2.0, 2.0]
    assert row[engine_shapes.NO_PICK]["vs_vllm"] == pytest.approx(2.0 / 1.5)
