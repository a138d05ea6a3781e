"""How often a sampled top-k / top-p step is given back to vLLM at the cut's edge
(commfold.shard.bounds): on rows shaped like a language model's (Zipf-ranked
log-probabilities with noise, shuffled over V = 151936 ids, bf16-rounded, at a
temperature), the bounds from 2 shards, then Gumbel draws (torch's noise: V2's in
distribution) counting rows whose best token between the bounds beats the best above
them. Also the share of rows whose cut is exact (nothing between) and the bytes the
bounds' all-gather adds per row per rank, next to vLLM's logits gather.

    python -m benchmarks.bench_cut_edge            # prints a markdown table
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

VOCAB, WORLD = 151936, 2


def model_rows(rows: int, zipf: float, temperature: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float64)
    out = torch.empty(rows, VOCAB)
    for r in range(rows):
        logp = -zipf * ranks.log() + 0.5 * torch.randn(VOCAB, generator=g, dtype=torch.float64)
        out[r] = logp[torch.randperm(VOCAB, generator=g)].float()
    return (out.bfloat16().float() + 12.0) / temperature


def measure(rows: int, zipf: float, temperature: float, top_k: int, top_p: float,
            draws: int, seed: int) -> dict:
    from commfold.shard import bounds as cut

    x = model_rows(rows, zipf, temperature, seed)
    k = torch.full((rows,), top_k or VOCAB, dtype=torch.int64)
    p = torch.full((rows,), top_p, dtype=torch.float32)
    shard = -(-VOCAB // WORLD)
    m = cut.candidates(k, p, VOCAB, shard)
    payloads = [cut._payload(SimpleNamespace(rank=lambda r=r: r),
                             x[:, r * shard:(r + 1) * shard], m) for r in range(WORLD)]
    bounds = cut._bounds(torch.stack(payloads), m, k, p.double(), VOCAB,
                         cut.block_size("cuda"))
    if isinstance(bounds, str):
        return dict(reason=bounds, bytes=payloads[0].shape[1] * 8)
    wide = x.double()
    sure = bounds.rows[:, None] & (wide > bounds.keep[:, None]) | ~bounds.rows[:, None]
    near = bounds.rows[:, None] & ~sure & (wide >= bounds.drop[:, None])
    exact = int((~near.any(-1)).sum())
    g = torch.Generator().manual_seed(seed + 1)
    edge = 0
    for _ in range(draws):
        noise = -torch.empty_like(x).exponential_(generator=g).log()
        noised = x + noise
        best = torch.where(sure, noised, float("-inf")).amax(-1)
        rival = torch.where(near, noised, float("-inf")).amax(-1)
        edge += int((rival >= best).sum())
    return dict(reason=None, exact=exact / rows, edge=edge / (rows * draws),
                bytes=payloads[0].shape[1] * 8)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--draws", type=int, default=50)
    args = ap.parse_args(argv)
    print("| zipf | T | top_k | top_p | rows with an exact cut | rows given back per draw"
          " | step of 64 rows given back | bounds bytes / row / rank | vLLM's gather |")
    print("|---|---|---|---|---|---|---|---|---|")
    for zipf in (1.0, 1.3):
        for temperature in (0.7, 1.0):
            for top_k, top_p in ((50, 1.0), (20, 1.0), (0, 0.9), (0, 0.95), (50, 0.95)):
                res = measure(args.rows, zipf, temperature, top_k, top_p, args.draws, 7)
                gather = f"{VOCAB // WORLD * 2:,} B (bf16)"
                if res["reason"]:
                    print(f"| {zipf} | {temperature} | {top_k or '-'} | {top_p} | "
                          f"given back: {res['reason']} | | | {res['bytes']} | {gather} |")
                    continue
                step = 1 - (1 - res["edge"]) ** 64
                print(f"| {zipf} | {temperature} | {top_k or '-'} | {top_p} | "
                      f"{res['exact']:.0%} | {res['edge']:.2%} | {step:.0%} | "
                      f"{res['bytes'] + 16} | {gather} |")


if __name__ == "__main__":
    main()
