"""DSpark's greedy draft block, the pick alone: vLLM's one gather of the block's base
draft logits vs commfold.vllm.spec_decode.dspark_pick's one (value, index) exchange per position,
at TP=2 in vLLM's own TP group, its CPU shared-memory communicator and gloo side by
side in one run, on vLLM's real ParallelLMHead + LogitsProcessor and DSpark Markov
head (harness/dspark_block.py), bf16:

- vLLM: the gather of the [reqs x positions, vocab shard] base logits, then per
  position the full-vocab bias add and ``argmax``;
- commfold: per position this rank's slice of the bias added to its shard and
  commfold.ops.local_argmax (one [reqs, 2] pair exchange).

The LM-head matmul and the Markov head's bias (the same work both ways) are computed
once outside the timed calls, so the difference the cost rule weighs (commfold.cost,
DSPARK_PICK) is not lost in their noise. Paired rounds (harness.bench), the slowest
rank's time per block; speed-up = vLLM / commfold, median over rounds with its
quartiles. Each configuration also runs the whole block both ways once (vLLM's own
_sample_sequential and the hooked one): "same" is their tokens' equality.

    python -m benchmarks.bench_dspark_pick
    python -m benchmarks.bench_dspark_pick --vocab 1000 151936 --reqs 1 --positions 3
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from commfold.distributed.ranks import run_on_ranks
from harness.bench import comm_of_variants, paired_ratio, paired_rounds

HIDDEN, RANK = 256, 64


def measure(vocabs, reqs_list, positions_list, rounds, comms):
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    from commfold.config import Config
    from commfold.ops.local_argmax import local_argmax
    from commfold.vllm.spec_decode import dspark_pick
    from harness import dspark_block as db
    from harness.vllm_tp import init_vllm_tp

    current_platform.register_triton_kernel_overrides()
    os.environ["COMMFOLD_PICK_COST_RULE"] = "0"  # the pick timed, not the rule's choice
    original = DSparkSpeculator.__dict__["_sample_sequential"]
    original = getattr(original, "__wrapped__", original)
    dspark_pick.hook(Config(passes=("local_argmax",)))
    rows = []
    for comm in comms:
        init_vllm_tp(2, shm=comm == "shm")
        for vocab in vocabs:
            model = db.drafter(vocab, HIDDEN, RANK, torch.bfloat16, seed=0, ties=False)
            head = dspark_pick.find_head(model)
            for reqs in reqs_list:
                for positions in positions_list:
                    spec = db.speculator(model, reqs, positions, seed=1)
                    g = torch.Generator().manual_seed(2)
                    h = torch.randn(reqs * positions, HIDDEN, generator=g).to(torch.bfloat16)
                    theirs, _ = db.run_block(spec, h, original)
                    ours, _ = db.run_block(spec, h, DSparkSpeculator._sample_sequential)
                    shard = head.local_logits(h, compute=model.compute_draft_logits)
                    prev = torch.randint(0, vocab, (positions, reqs), generator=g)
                    bias = [model.markov_bias(model.markov_embed(p)) for p in prev]
                    lo = torch.distributed.get_rank() * head.shard

                    def vllm_pick(x, bias=bias):
                        base = head.gather(x).view(reqs, positions, -1)
                        return [(base[:, i] + b).argmax(-1) for i, b in enumerate(bias)]

                    def commfold_pick(x, bias=bias):
                        base = x.view(reqs, positions, -1)
                        out = []
                        for i, b in enumerate(bias):
                            cols = b[:, lo:lo + head.shard]
                            pad = head.shard - cols.shape[-1]
                            if pad:
                                cols = torch.nn.functional.pad(cols, (0, pad))
                            out.append(local_argmax(base[:, i] + cols, vocab, head.comm)[1])
                        return out

                    variants = {"vllm": vllm_pick, "commfold": commfold_pick}
                    same = torch.equal(ours, theirs) and all(
                        torch.equal(a, b) for a, b in zip(vllm_pick(shard), commfold_pick(shard)))
                    times = paired_rounds(variants, (shard,), rounds)
                    rows.append(dict(comm=comm, vocab=vocab, reqs=reqs, positions=positions,
                                     same=same, t={k: statistics.median(v)
                                                   for k, v in times.items()},
                                     ratio=paired_ratio(times, "vllm", "commfold"),
                                     c=comm_of_variants(variants, (shard,))))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[1000, 32000, 151936])
    p.add_argument("--reqs", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--positions", type=int, nargs="+", default=[3, 7])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--comms", nargs="+", default=["shm", "gloo"], choices=["shm", "gloo"])
    a = p.parse_args(argv)
    rows = run_on_ranks(measure, 2, a.vocab, a.reqs, a.positions, a.rounds, a.comms,
                        timeout=3600)[0]
    print(f"DSpark draft block, the pick alone (no LM head, no Markov head), TP=2, bf16, "
          f"paired rounds (slowest rank per block), {a.rounds} rounds")
    print("| comm | V | reqs | positions | vLLM (ms) | commfold (ms) | speed-up (q1-q3) | same "
          "| vLLM: calls, bytes/rank | commfold: calls, bytes/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, q, c = r["t"], r["ratio"], r["c"]
        print(f"| {r['comm']} | {r['vocab']} | {r['reqs']} | {r['positions']} | "
              f"{t['vllm'] * 1e3:.3f} | {t['commfold'] * 1e3:.3f} | {q['median']:.2f}x "
              f"({q['q1']:.2f}-{q['q3']:.2f}) | {r['same']} | {c['vllm']['calls']}, "
              f"{c['vllm']['bytes']} | {c['commfold']['calls']}, {c['commfold']['bytes']} |")


if __name__ == "__main__":
    main()
