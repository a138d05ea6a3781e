"""On PYTHONPATH for a vLLM engine on Model Runner V2 (tests only): every process the
engine starts registers the Triton CPU stand-in before it imports vLLM."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
from harness import triton_cpu  # noqa: E402

triton_cpu.install()

if os.environ.get("HARNESS_DSPARK"):  # "shipped" or "sharded": harness.dspark_cpu
    from harness import dspark_cpu  # noqa: E402

    dspark_cpu.install(sharded=os.environ["HARNESS_DSPARK"] == "sharded")
