"""Every examples/*.py runs in one command on this CPU and exits 0 (each checks its own
tokens against the program without commfold and exits non-zero on a difference).

Opt-in (`slow`: `python -m pytest -m slow tests/test_examples.py`): each example is a
fresh process that spawns its ranks and compiles its model twice, ~2 CPU-minutes an
example on 2 cores, and what they run is in the default suite on ranks: DTensor norms
and picks (test_fuse_allreduce_rmsnorm's decoders, test_local_argmax, test_fuzz), a
drafter's replicated embedding and head (test_replicate_vocab_parallel,
tools/vllm_spec_check's engines), the funcol decoder example under `commfold diff`
(test_cli)."""
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "__init__.py")
# Engine starts are the suite's dearest seconds, so none is paid twice:
# vllm_greedy.py (greedy tokens identical with the plugin on, a tiny Qwen3 at TP=2; with
# --draft, speculative decoding) is what test_vllm_engine.py's and
# test_vllm_spec_decode.py's engines assert in more detail; `-m slow` runs it here too.
# tp_decoder_funcol.py runs whole on 2 ranks under
# `commfold diff` in test_cli.py, which asserts its own token check in each rank's log.
RUN_ELSEWHERE = {"tp_decoder_funcol.py"}


def _example(script: Path):
    """Every example is `slow`; a CPU example starts ranks, the vLLM one engines."""
    marks = ([pytest.mark.vllm, pytest.mark.engine] if script.name.startswith("vllm_")
             else [pytest.mark.ranks])
    return pytest.param(script, marks=[pytest.mark.slow, *marks], id=script.stem)


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert {"tp_decoder_funcol.py", "tp_decoder_dtensor.py", "vllm_greedy.py"} <= names


@pytest.mark.parametrize("script", [_example(p) for p in EXAMPLES
                                    if p.name not in RUN_ELSEWHERE])
def test_example_runs(script, tmp_path):
    # as the README runs them: a module of the checkout, from its root
    done = subprocess.run([sys.executable, "-m", f"examples.{script.stem}"], capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, (f"{script.name} exit {done.returncode}\n{done.stdout}\n"
                                  f"{done.stderr}")
    if script.name == "vllm_greedy.py" and importlib.util.find_spec("vllm") is None:
        assert "skipped - vLLM is not installed" in done.stdout
    elif script.name == "vllm_greedy.py":
        assert "greedy tokens identical with and without commfold" in done.stdout
        # rank 0's report of the target's graph: its small embedding replicated
        assert "commfold, rank 0, graph 0:" in done.stdout
        assert "vocab_parallel_embedding" in done.stdout
    elif script.name.startswith("tp_decoder_"):
        assert ("greedy tokens identical to stock Inductor on 2 rank(s), and across ranks"
                in done.stdout)
        assert "commfold report, graph 0:" in done.stdout
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("rewrites per pass"))
        per_rank = ast.literal_eval(line.split(":", 1)[1].strip())
        assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
        # the vocab-sharded LM head's gather is taken by local_argmax or replication
        taken = per_rank[0].get("local_argmax", 0) + per_rank[0].get("replicate_vocab_parallel", 0)
        assert taken >= 1
