"""The greedy pick over vLLM's real vocab-parallel LM head at TP=2 (vLLM's own
ParallelLMHead + LogitsProcessor, LM-head matmul included), side by side in one run:

- ``vllm``: vLLM's hand-written ``LogitsProcessor.get_top_tokens`` (per-rank max, a
  gather of (value, index) pairs) - the strongest alternative a vLLM user has;
- ``gather``: the full logits gathered, then argmax (vLLM's default path);
- ``commfold``: ``commfold.vllm.spec_decode.top_tokens.lm_head_top_tokens`` (compute_logits ->
  argmax compiled with the local_argmax pass).

At batch 1 the LM-head matmul is 90-99% of each call, so the variants differ by a
few percent: calls are timed in paired rounds (harness.bench.paired_rounds: every
variant in every position equally often) and compared round by round.

    python -m benchmarks.bench_vllm_lm_head                     # shm and gloo, B 1/8/64
    python -m benchmarks.bench_vllm_lm_head --comm gloo --batch 1 --vocab 151936

Communicators: vLLM CPU's shared-memory one where its kernel build has it
(``shm_supported()``), and the torch.distributed (gloo) fallback always. Reported:
median times and the ratios vllm / commfold and gather / commfold per round (> 1:
commfold is faster); every variant's tokens are checked equal. ``measure`` is the
rank-side function the suite runs.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from commfold.distributed.ranks import RankPool
from harness.bench import paired_ratio, paired_rounds


def _head(vocab: int, hidden: int, dtype):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    torch.manual_seed(0)
    lm = ParallelLMHead(vocab, hidden, params_dtype=dtype)
    with torch.no_grad():
        lm.weight.normal_(0, 0.05)
    lm.quant_method.process_weights_after_loading(lm)
    return lm, LogitsProcessor(vocab)


def measure(comms, batches, vocabs, hidden: int, iters: int, dtype: str = "float32"):
    """On every rank (a RankPool of 2): one row per (communicator, V, B)."""
    from harness.vllm_tp import init_vllm_tp, shm_supported
    from commfold.vllm.spec_decode.top_tokens import lm_head_top_tokens

    dt = getattr(torch, dtype)
    rows = []
    for comm in comms:
        if comm == "shm" and not shm_supported():
            continue
        torch._dynamo.reset()
        tp = init_vllm_tp(2, shm=comm == "shm")
        for vocab in vocabs:
            lm, lp = _head(vocab, hidden, dt)
            variants = {"vllm": lambda h, lp=lp, lm=lm: lp.get_top_tokens(lm, h),
                        "gather": lambda h, lp=lp, lm=lm: lp(lm, h).argmax(-1),
                        "commfold": lm_head_top_tokens(lp, lm)}
            for b in batches:
                g = torch.Generator().manual_seed(b)
                h = torch.randn(b, hidden, generator=g).to(dt)
                tokens = {k: f(h) for k, f in variants.items()}
                same = all(torch.equal(tokens["gather"], t) for t in tokens.values())
                t = paired_rounds(variants, (h,), iters)
                rows.append({"communicator": comm, "V": vocab, "B": b, "H": hidden, "dtype": dtype,
                             "world": tp.world_size, "same": same,
                             **{f"{k}_s": statistics.median(v) for k, v in t.items()},
                             **{f"{k}_ratio": paired_ratio(t, k, "commfold")
                                for k in ("vllm", "gather")}})
            del lm, lp, variants
    return rows


def table(rows) -> str:
    out = ["| comm | V | B | vLLM get_top_tokens (ms) | gather + argmax (ms) | commfold (ms) "
           "| vs vLLM | vs gather | same |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['communicator']} | {r['V']} | {r['B']} | {r['vllm_s'] * 1e3:.3f} | "
                   f"{r['gather_s'] * 1e3:.3f} | {r['commfold_s'] * 1e3:.3f} | "
                   f"{_ratio(r['vllm_ratio'])} | {_ratio(r['gather_ratio'])} | {r['same']} |")
    return "\n".join(out)


def _ratio(q) -> str:
    return f"{q['median']:.3f}x [{q['q1']:.2f}-{q['q3']:.2f}]"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comm", nargs="+", default=["shm", "gloo"], choices=["shm", "gloo"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=24)
    a = p.parse_args(argv)
    pool = RankPool(2, timeout=3600, threads=1)
    try:
        rows = pool.run(measure, a.comm, a.batch, a.vocab, a.hidden, a.iters, a.dtype)[0]
    finally:
        pool.close()
    print(f"greedy pick over vLLM's LM head, TP=2, H={a.hidden}, {a.dtype}, "
          f"{a.iters} paired rounds (rank 0; a round's time is its slowest rank's); "
          "ratios: median [quartiles] over rounds of the other's time / commfold's")
    print(table(rows))


if __name__ == "__main__":
    main()
