"""A tensor-parallel decoder in plain torch with functional collectives, compiled with
commfold; greedy tokens checked against stock Inductor.

The model (commfold/cli/demo_model.py) is ordinary TP inference code: a vocab-parallel
embedding (mask, offset, lookup, zero, all_reduce), per block all_reduce -> residual
add -> hand-written RMSNorm, and a vocab-sharded LM head (matmul, all_gather on the
vocab dim, slice off the padding, argmax). Nothing in it mentions commfold; only the
torch.compile backend changes.

    python -m examples.tp_decoder_funcol                    # spawns 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 -m examples.tp_decoder_funcol
    commfold diff examples/tp_decoder_funcol.py             # dump each rewrite
"""
from commfold.cli.demo_model import (DecoderConfig, TPDecoder, greedy_decode,
                                     greedy_vs_inductor, sample_ids, show_comparison)
from commfold.distributed.ranks import run_here_or_spawn

CONFIG = DecoderConfig(vocab=1001, hidden=64, layers=2, heads=4, ffn=128)  # 1001: padded
BATCH, SEQ, STEPS = 4, 8, 4


def main() -> dict:
    """One rank's work (its process group is initialized)."""
    model = TPDecoder(CONFIG)
    ids = sample_ids(CONFIG, BATCH, SEQ)
    return greedy_vs_inductor(lambda step, x: greedy_decode(step, x, STEPS), model, ids)


if __name__ == "__main__":
    show_comparison(run_here_or_spawn(main))
