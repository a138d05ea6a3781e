"""The A/A control for the real-shape engine benchmark (benchmarks/engine_shapes.py):
two engines of vLLM as shipped, started and paired exactly as vLLM's and commfold's
are there, so the spread of their ratio (the second-started over the first) says how
far from 1.0 a ratio must be before it is a difference on this machine.

    python -m benchmarks.engine_aa --shape llama-3.2-1b --rounds 4

Prints per round and the medians; writes no results file.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import engine_shapes as es  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b", choices=list(es.SHAPES))
    ap.add_argument("--layers", type=int)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args(argv)
    from harness.vllm_engine import BASE_ENV

    os.environ.update(BASE_ENV)
    model = es.write_shape(Path(tempfile.gettempdir()) / "commfold-bench-shapes", a.shape,
                           a.layers)
    ratios: dict[int, list[float]] = {c: [] for c in a.concurrency}
    with es.open_engine(model, "vllm", a.concurrency, a.tokens) as first, \
            es.open_engine(model, "vllm", a.concurrency, a.tokens) as second:
        batch = es.prompts(max(a.concurrency), first.llm_engine.model_config.get_vocab_size())
        for llm in (first, second):
            for c in a.concurrency:
                es.generate(llm, batch[:c], 4, "greedy")
        for r in range(a.rounds):
            for c in a.concurrency:
                secs = {}
                pair = [("first", first), ("second", second)]
                for name, llm in pair[::1 if r % 2 == 0 else -1]:
                    time.sleep(es.IDLE_S)
                    secs[name] = es.timed(llm, batch[:c], a.tokens, "greedy", a.runs)["seconds"]
                ratios[c].append(secs["first"] / secs["second"])
                print(f"round {r + 1} C={c}: second-started / first speed "
                      f"{ratios[c][-1]:.3f}", flush=True)
    for c, xs in ratios.items():
        print(f"C={c}: median {statistics.median(xs):.3f}, rounds "
              + " ".join(f"{x:.3f}" for x in xs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
