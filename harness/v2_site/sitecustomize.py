"""On PYTHONPATH for a vLLM engine on Model Runner V2 (tests only): every process the
engine starts registers the Triton CPU stand-in before it imports vLLM."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
from harness import triton_cpu  # noqa: E402

triton_cpu.install()

if os.environ.get("HARNESS_DSPARK_SHARDED") == "1":  # DSpark's Markov head, sharded
    from harness import dspark_sharded  # noqa: E402

    dspark_sharded.install()
