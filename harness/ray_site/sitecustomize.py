"""On PYTHONPATH for a vLLM engine on Ray's executor (tests only): every process the
engine or Ray starts gives vLLM's CPU platform a Ray device key (harness.ray_cpu)
before it imports vLLM."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
from harness import ray_cpu  # noqa: E402

ray_cpu.install()
