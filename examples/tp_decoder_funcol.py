"""A tensor-parallel decoder in plain torch with functional collectives, compiled with
commfold; greedy tokens checked against stock Inductor.

The model (commfold/models.py) is ordinary TP inference code: a vocab-parallel
embedding (mask, offset, lookup, zero, all_reduce), per block all_reduce -> residual
add -> hand-written RMSNorm, and a vocab-sharded LM head (matmul, all_gather on the
vocab dim, slice off the padding, argmax). Nothing in it mentions commfold; only the
torch.compile backend changes.

    python examples/tp_decoder_funcol.py                    # spawns 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/tp_decoder_funcol.py
    commfold diff examples/tp_decoder_funcol.py             # dump each rewrite
"""
import os

import torch
import torch.distributed as dist

import commfold
from commfold.models import DecoderConfig, TPDecoder, greedy_decode, sample_ids

CONFIG = DecoderConfig(vocab=1001, hidden=64, layers=2, heads=4, ffn=128)  # 1001: padded
BATCH, SEQ, STEPS = 4, 8, 4


def main() -> dict:
    """One rank's work (its process group is initialized)."""
    model = TPDecoder(CONFIG)
    ids = sample_ids(CONFIG, BATCH, SEQ)
    with torch.no_grad():
        expected = greedy_decode(torch.compile(model, backend="inductor"), ids, STEPS)
        commfold.clear_reports()
        tokens = greedy_decode(torch.compile(model, backend="commfold"), ids, STEPS)
    if not torch.equal(tokens, expected):
        raise AssertionError(f"rank {dist.get_rank()}: commfold changed the greedy tokens:\n"
                             f"{tokens}\nvs stock Inductor\n{expected}")
    report = commfold.last_report()
    return {"rank": dist.get_rank(), "tokens": tokens.tolist(), "summary": report.summary(),
            "rewrites": {p: report.count(p) for p in commfold.ALL_PASSES}}


def show(results: list) -> None:
    print(results[0]["summary"])
    print("rewrites per pass, per rank:", [r["rewrites"] for r in results])
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    print(f"greedy tokens identical to stock Inductor on {len(results)} rank(s)"
          f"{', and across ranks' if same else ''}: {results[0]['tokens']}")
    if not same:
        raise SystemExit("ranks produced different tokens")


if __name__ == "__main__":
    if "RANK" in os.environ:  # torchrun or `commfold diff`: this process is one rank
        dist.init_process_group("gloo")
        show([main()])
        dist.destroy_process_group()
    else:
        from commfold.testing import run_on_ranks

        show(run_on_ranks(main, 2))
