"""End to end: a greedy decode loop of a small TP decoder (commfold.cli.demo_model.TPDecoder)
whose LM head and argmax are inside the compiled graph, with and without commfold,
side by side in one run (TP=2 on this CPU, gloo).

    python -m benchmarks.bench_decode                      # V=151936, batch 1 and 8
    python -m benchmarks.bench_decode --batch 1 --steps 8 --layers 2

Each timed call decodes --steps tokens per row over a fixed --seq window (one
compile per variant); tokens/s = batch x steps / median time. Communication is one
decode step's, per rank. With hidden 64 the embedding's full weight (V x 64 f32,
37 MiB) is under replicate_max_bytes: commfold replicates it (its all-reduce goes),
fuses each layer's two all-reduce + RMSNorm (the all-reduces stay) and leaves the
LM head (over the 4 MiB argmax rule) to local_argmax: the lower bound of the
rewritten step (``step_bound``, from the rewrites the report lists) is then
2 x layers all-reduces of B x S x H f32 values plus one (value, index) int64 pair
per row. ``measure`` is the rank-side function the suite runs.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import commfold
from commfold.cli.demo_model import DecoderConfig, TPDecoder, greedy_decode, sample_ids
from commfold.distributed.ranks import run_on_ranks
from harness.bench import comm_of_variants, time_side_by_side


def step_bound(rewrites, batch, seq, hidden, layers, shard_vocab) -> dict:
    """Least communication of one decode step in the rewritten form, per rank: the
    2 x layers all-reduces of the activations (fused with the norms, never removed),
    the embedding's all-reduce unless replicated, and for the greedy pick one int64
    pair per row (local_argmax), nothing (replicated head) or the logits gather."""
    act = batch * seq * hidden * 4
    b, calls = 2 * layers * act, 2 * layers
    if "replicate_vocab_parallel:vocab_parallel_embedding" not in rewrites:
        b, calls = b + act, calls + 1
    if "local_argmax:all_gather->argmax" in rewrites:
        b, calls = b + 16 * batch, calls + 1
    elif "replicate_vocab_parallel:vocab_parallel_lm_head" not in rewrites:
        b, calls = b + batch * shard_vocab * 4, calls + 1
    return {"bytes": b, "calls": calls}


def measure(vocab, hidden, layers, batches, seq, steps, iters) -> list[dict]:
    """On every rank: one row per batch size: median seconds per decode of `steps`
    tokens, tokens/s, equal tokens, communication per step vs the bound."""
    world = dist.get_world_size()
    torch._dynamo.reset()
    cfg = DecoderConfig(vocab=vocab, hidden=hidden, layers=layers, heads=4, ffn=4 * hidden)
    model = TPDecoder(cfg)
    steps_fn = {"inductor": torch.compile(model, backend="inductor"),
                "commfold": torch.compile(model, backend="commfold")}
    rows = []
    for b in batches:
        ids = sample_ids(cfg, b, seq)
        commfold.clear_reports()
        decode = {k: (lambda x, f=f: greedy_decode(f, x, steps)) for k, f in steps_fn.items()}
        tokens = {k: f(ids) for k, f in decode.items()}
        rewrites = sorted(f"{r.pass_name}:{r.pattern}" for rep in commfold.reports()
                          for r in rep.rewrites)
        t = time_side_by_side(decode, (ids,), iters, warmup=1)
        comm = comm_of_variants(steps_fn, (ids,))
        comm["bound"] = step_bound(rewrites, b, seq, hidden, layers, -(-vocab // world))
        rows.append({"baseline": "inductor", "rewritten": "commfold", "world": world,
                     "V": vocab, "hidden": hidden, "layers": layers, "B": b, "seq": seq,
                     "steps": steps, "inductor_s": t["inductor"], "commfold_s": t["commfold"],
                     "inductor_tok_s": b * steps / t["inductor"],
                     "commfold_tok_s": b * steps / t["commfold"],
                     "same": torch.equal(tokens["inductor"], tokens["commfold"]),
                     "rewrites": rewrites, "comm": comm})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--world-size", type=int, default=2)
    a = p.parse_args(argv)
    rows = run_on_ranks(measure, a.world_size, a.vocab, a.hidden, a.layers, a.batch, a.seq,
                        a.steps, a.iters, timeout=3600)[0]
    print(f"greedy decode, TP={a.world_size}, V={a.vocab}, hidden {a.hidden}, {a.layers} layers, "
          f"window {a.seq}, {a.steps} tokens per call, median of {a.iters} (rank 0)")
    print("| B | Inductor tok/s | commfold tok/s | speed-up | same tokens "
          "| bytes/step: Inductor | commfold | bound |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["comm"]
        print(f"| {r['B']} | {r['inductor_tok_s']:.1f} | {r['commfold_tok_s']:.1f} | "
              f"{r['inductor_s'] / r['commfold_s']:.2f}x | {r['same']} | "
              f"{c['inductor']['bytes']} | {c['commfold']['bytes']} | {c['bound']['bytes']} |")


if __name__ == "__main__":
    main()
