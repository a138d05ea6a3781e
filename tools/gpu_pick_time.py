"""The compute side of the GPU estimate (docs/performance.md, "GPU estimate: what the
bytes are worth"): on one GPU, a rank's work for commfold's picks over one vocab
shard against vLLM's sampler math over the gathered row, at the real shapes.

    python tools/gpu_pick_time.py [--out DIR] [--repeats N]   # on the GPU (~1 min)
    python tools/gpu_pick_time.py --cpu-dry-run               # the same code on CPU, tiny

One GPU is lent, so no collective is timed (NCCL's share comes from published figures,
not from here): each row times what a rank computes besides the exchange, both ways.

- greedy: vLLM gathers the row and takes ``argmax`` over the whole vocab (float32, as
  its sampler reads logits); commfold takes the argmax of its shard and packs one
  (value, index) pair.
- sampled: vLLM's sampler math over the whole row, written here as the reference being
  timed (float32 copy, temperature, softmax, min_p, top-p by a sort and cumulative
  sum, an exponential race: the draw V1's torch path makes); commfold's over its shard:
  float32 copy, temperature, the shard's maximum (min_p's exchange carries it), its
  top 50 values (the top-k / top-p bounds' payload), a Gumbel-noised argmax.

Medians of ``--repeats`` calls, the device synchronized around each; times in
microseconds, "full / shard" > 1 meaning the shard's work is cheaper. Nothing here
imports commfold or vLLM: torch only, so the device image needs nothing else.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SHAPES = {"llama-3.2": 128256, "qwen3": 151936}  # vocab sizes (Llama-3.2-1B/3B, Qwen3-1.7B)
WORLDS = (2, 4, 8)
ROWS = (1, 8, 64)
TOP_K_PAYLOAD = 50
HEADER = ["shape", "vocab", "TP", "rows", "pick", "full row (us)", "one shard (us)",
          "full / shard"]


def shard_width(vocab: int, world: int) -> int:
    """vLLM's per-rank columns: the vocab padded to 64, split evenly."""
    return -(-vocab // 64) * 64 // world


def greedy_full(row: torch.Tensor) -> torch.Tensor:
    return row.float().argmax(-1)


def greedy_shard(shard: torch.Tensor, start: int) -> torch.Tensor:
    value, index = shard.float().max(-1)
    return torch.stack([value.view(torch.int32).long(), index + start], -1)


def sampled_full(row: torch.Tensor, temperature: float = 0.7, top_p: float = 0.9,
                 min_p: float = 0.05) -> torch.Tensor:
    """The reference: a sampler's math over the gathered row (written for this check)."""
    x = row.float() / temperature
    probs = x.softmax(-1)
    probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    sorted_p, order = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    sorted_p = sorted_p.masked_fill(~keep, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    race = torch.empty_like(probs).exponential_()
    return probs.div_(race).argmax(-1)


def sampled_shard(shard: torch.Tensor, start: int, temperature: float = 0.7) -> torch.Tensor:
    """A rank's work for commfold's sampled pick over its columns."""
    x = shard.float() / temperature
    top = x.amax(-1)
    bounds = x.topk(min(TOP_K_PAYLOAD, x.shape[-1]), -1).values
    u = torch.rand_like(x).clamp_(min=1e-20)
    value, index = (x - (-u.log()).log()).max(-1)
    return torch.cat([torch.stack([value, top], -1), bounds[:, :2]], -1), index + start


PICKS = {"greedy": (greedy_full, greedy_shard), "sampled": (sampled_full, sampled_shard)}


def median_us(fn, sync, repeats: int) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(device: str, shapes: dict[str, int], worlds, rows, repeats: int) -> list[dict]:
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for name, vocab in shapes.items():
        for r in rows:
            row = (torch.randn(r, vocab, generator=g) * 4).bfloat16().to(dev)
            # the full row's work is the same at every TP: timed once per pick
            fulls = {pick: median_us(lambda f=full, x=row: f(x), sync, repeats)
                     for pick, (full, _) in PICKS.items()}
            for world in worlds:
                width = shard_width(vocab, world)
                shard = row[:, :min(width, vocab)].contiguous()
                for pick, (_, local) in PICKS.items():
                    a = fulls[pick]
                    b = median_us(lambda f=local, x=shard: f(x, 0), sync, repeats)
                    out.append({"shape": name, "vocab": vocab, "TP": world, "rows": r,
                                "pick": pick, "full_us": round(a, 1), "shard_us": round(b, 1),
                                "ratio": round(a / b, 2)})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = [r["shape"], r["vocab"], r["TP"], r["rows"], r["pick"], r["full_us"],
                 r["shard_us"], f"{r['ratio']}x"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write gpu_pick_time.{md,json} here")
    p.add_argument("--repeats", type=int, default=31)
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run on CPU at a tiny vocab (checks the script, not a figure)")
    args = p.parse_args(argv)
    if args.cpu_dry_run:
        device, shapes, repeats = "cpu", {"tiny": 1000}, 3
    elif torch.cuda.is_available():
        device, shapes, repeats = "cuda", SHAPES, args.repeats
    else:
        print("gpu pick time: no CUDA GPU (--cpu-dry-run checks the script on CPU)")
        return 0
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)"
    rows = measure(device, shapes, WORLDS, ROWS, repeats)
    text = f"device: {name}, torch {torch.__version__}\n\n{table(rows)}"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_pick_time.md").write_text(text + "\n")
        (args.out / "gpu_pick_time.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
