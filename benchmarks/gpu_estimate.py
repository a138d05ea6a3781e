"""An estimate on paper, not a measurement: what the bytes of
benchmarks/results/traffic_bytes.json are worth in collective time on H100 / H200
NVLink, from published NCCL figures, and the CUDA entries of commfold.cost derived
from the same figures (tests/test_gpu_estimate.py ties the two).

    python -m benchmarks.gpu_estimate        # writes benchmarks/results/gpu_estimate.md

The published figures (each quoted where it is used):

- SGLang's symmetric-memory benchmark, benchmark/kernels/all_reduce/bench_symm.sh
  (sgl-project/sglang, commit 8e17681e8cdcbc43c47bc4d1de0bc46a0de9f6f5): H100, 8 GPUs,
  bf16, all-gather and all-to-all at 2-128 KiB per rank (the tensor a rank hands the
  collective, as benchmark_symm_mem.py sizes it), torch.distributed eager and PyNccl
  symmetric memory in a CUDA graph, microseconds;
- the NCCL maintainer's figure for large messages (NVIDIA/nccl-tests#212, sjeaugey,
  2024-05-06): NCCL reaches ~370 GB/s bus bandwidth over H100 NVLink for collectives
  other than all-reduce (450 GB/s line rate less ~20 % protocol overhead).

Model: a collective of up to 128 KiB per rank costs the table's time (interpolated
between its sizes, the 2 KiB figure below 2 KiB); past 128 KiB, the 128 KiB time plus
the extra bytes each rank receives at 370 GB/s (all-gather: (N - 1) x part; all-to-all:
(N - 1) / N x its send buffer). The table is 8 GPUs: used as-is for TP=2 and 4 (an
upper bound on their latency term). H200's NVLink is H100's (NVLink 4, 900 GB/s per GPU,
NVIDIA's datasheets), so the same figures are used for it. vLLM computes the logits and
samples outside its CUDA graphs, so the eager column is the one a step pays; the graph
column is shown for what a captured path would pay.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.traffic_formulas import shard  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
SOURCE = ("sgl-project/sglang benchmark/kernels/all_reduce/bench_symm.sh "
          "@8e17681e (H100, 8 GPUs, bf16)")
BUSBW = "NVIDIA/nccl-tests#212 (sjeaugey: ~370 GB/s bus bandwidth, H100 NVLink)"
SIZES = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
AG = {"eager": (14.57, 14.58, 14.42, 14.03, 14.37, 15.94, 18.14),
      "graph": (2.68, 2.84, 3.11, 4.70, 5.07, 5.35, 6.90)}
A2A = {"eager": (18.34, 17.87, 17.84, 17.70, 17.90, 24.99, 21.18),
       "graph": (5.45, 5.51, 5.57, 5.57, 6.25, 6.82, 7.00)}
BYTES_PER_US = 370e3  # 370 GB/s
# step-time context: bf16 weights read once per decode step at the HBM bandwidth
# (NVIDIA's datasheets: H100 SXM 3.35 TB/s, H200 4.8 TB/s), parameters from the
# models' cards (Llama-3.2-1B 1.24 B, Llama-3.2-3B 3.21 B, Qwen3-1.7B 1.7 B)
HBM_BYTES_PER_US = {"H100": 3.35e6, "H200": 4.8e6}
PARAMS = {"llama-3.2-1b": 1.24e9, "qwen3-1.7b": 1.7e9, "llama-3.2-3b": 3.21e9}


def _table(times, size: int) -> float:
    if size <= SIZES[0]:
        return times[0]
    for (a, ta), (b, tb) in zip(zip(SIZES, times), zip(SIZES[1:], times[1:])):
        if size <= b:
            return ta + (tb - ta) * (size - a) / (b - a)
    raise ValueError(size)


def all_gather_us(part: int, world: int, mode: str = "eager") -> float:
    """An all-gather in which each rank hands `part` bytes."""
    if part <= SIZES[-1]:
        return _table(AG[mode], part)
    return AG[mode][-1] + (part - SIZES[-1]) * (world - 1) / BYTES_PER_US


def all_to_all_us(send: int, world: int, mode: str = "eager") -> float:
    """An all-to-all whose send buffer is `send` bytes per rank."""
    if send <= SIZES[-1]:
        return _table(A2A[mode], send)
    return A2A[mode][-1] + (send - SIZES[-1]) * (world - 1) / world / BYTES_PER_US


def exchanges_us(parts: list[int], world: int, mode: str = "eager") -> float:
    return sum(all_gather_us(p, world, mode) for p in parts)


# --- the cost rule's CUDA entries, derived (commfold.cost reads these numbers) ------

def logprobs_least(world: int = 2) -> int:
    """Bytes per rank of vLLM's gather below which it costs less than the two small
    exchanges of top-k logprobs (eager): 2 x the 2 KiB time against the gather's."""
    extra = 2 * AG["eager"][0] - AG["eager"][-1]
    return round(SIZES[-1] + extra * BYTES_PER_US / (world - 1))


def sampled_least(world: int = 2, exchanges: int = 3) -> int:
    """The same for a sampled step's exchanges (min_p's maxima, the bounds, the pair)."""
    extra = exchanges * AG["eager"][0] - AG["eager"][-1]
    return round(SIZES[-1] + extra * BYTES_PER_US / (world - 1))


def per_exchange_least(world: int = 2) -> int:
    """DSpark's block: bytes of the one gather per exchange commfold makes instead
    (each a 2 KiB-class all-gather), past which the gather is the dearer (eager)."""
    return round(AG["eager"][0] * BYTES_PER_US / (world - 1))


# --- the estimate's table ---------------------------------------------------------

def estimate_rows(traffic: dict) -> list[dict]:
    """Per (shape, kind, C, TP) of traffic_bytes.json: each way's collectives in
    microseconds (eager), with the step's weight-read floor on H100 and H200."""
    per_row: dict[str, list[float]] = {}  # kind -> each exchange's bytes per row
    for name, kinds in traffic.get("measured", {}).items():
        if name.endswith("-commfold"):
            for kind, by_c in kinds.items():
                c, fig = max(by_c.items(), key=lambda cf: int(cf[0]))
                per_row[kind] = [e["bytes"] / int(c) for e in fig["events"]]
    out = []
    for r in traffic["rows"]:
        world, c = r["TP"], r["C"]
        if r["kind"] not in ("greedy", "greedy+logprobs", "chat-top-p"):
            continue
        gather = all_gather_us(r["gather"], world)
        lp = "logprobs" in r["kind"]
        # commfold's exchanges as the TP=2 log listed them at the largest C measured,
        # per row (their widths do not follow the world size or the vocab)
        parts = [round(b * c) for b in per_row.get(r["kind"], [])] or \
            ([16 * c] if r["kind"] == "greedy" else None)
        ours = exchanges_us(parts, world) if parts else None
        sharded = None
        if r["batch-sharded"] is not None:
            a2a = c * shard(r["vocab"], world) * 2
            per = -(-c // world)
            sharded = all_to_all_us(a2a, world) + all_gather_us(per * 24, world) + \
                (all_gather_us(per * 56, world) + all_gather_us(per * 24, world) if lp else 0)
        floor = {g: PARAMS[r["shape"]] * 2 / world / bw for g, bw in HBM_BYTES_PER_US.items()}
        out.append({"shape": r["shape"], "kind": r["kind"], "C": c, "TP": world,
                    "gather_us": round(gather, 1),
                    "batch_sharded_us": None if sharded is None else round(sharded, 1),
                    "commfold_us": None if ours is None else round(ours, 1),
                    "saved_us": None if ours is None else round(gather - ours, 1),
                    "floor_h100_us": round(floor["H100"]), "floor_h200_us": round(floor["H200"])})
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["# GPU estimate (on paper, not measured)", "",
             f"Collective time from published figures: {SOURCE}; large messages at "
             f"{BUSBW}. Eager collectives (vLLM samples outside its CUDA graphs). H200: "
             "the same NVLink, the same figures; only the step floor differs. Floor: "
             "bf16 weights read once at HBM bandwidth, the least a decode step can take.",
             "", "| shape | kind | C | TP | gather (us) | batch-sharded (us) | commfold (us) | "
             "saved (us) | step floor H100 / H200 (us) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def f(x):
            return "–" if x is None else f"{x:,}"
        lines.append(f"| {r['shape']} | {r['kind']} | {r['C']} | {r['TP']} | "
                     f"{f(r['gather_us'])} | {f(r['batch_sharded_us'])} | "
                     f"{f(r['commfold_us'])} | {f(r['saved_us'])} | "
                     f"{r['floor_h100_us']:,} / {r['floor_h200_us']:,} |")
    lines += ["", "Cost rule entries derived from the same figures (commfold.cost, CUDA): "
              f"top-k logprobs local from {logprobs_least(2):,} B of logits per rank "
              f"(TP=2; {logprobs_least(4):,} at TP=4, {logprobs_least(8):,} at TP=8); "
              f"sampled steps local from {sampled_least(2):,} B (TP=2; "
              f"{sampled_least(8):,} at TP=8); "
              f"DSpark's block local from {per_exchange_least(2):,} B per exchange (TP=2); "
              "the greedy pick (one exchange instead of one gather) never slower."]
    return "\n".join(lines) + "\n"


def compact(rows: list[dict]) -> str:
    """docs/performance.md's table: per vocab, kind and C, each TP's gather /
    batch-sharded / commfold microseconds (the shapes sharing a vocab share them),
    and the step floors of each shape at TP=2 and 8."""
    by = {(r["shape"], r["kind"], r["C"], r["TP"]): r for r in rows}
    groups = {"Llama-3.2-1B / 3B (V=128256)": ("llama-3.2-1b", "llama-3.2-3b"),
              "Qwen3-1.7B (V=151936)": ("qwen3-1.7b",)}
    kinds = ("greedy", "greedy+logprobs", "chat-top-p")
    lines = ["Each cell: vLLM's gather / batch-sharded / commfold, microseconds of eager "
             "collectives per decode step (* dearer than the gather).", "",
             "| shape | kind | C | TP=2 | TP=4 | TP=8 |", "|---|---|---|---|---|---|"]
    for label, shapes in groups.items():
        for kind in kinds:
            for c in (1, 8, 64):
                cells = []
                for world in (2, 4, 8):
                    r = by.get((shapes[0], kind, c, world))
                    if r is None or r["commfold_us"] is None:
                        cells.append("–")
                        continue
                    b = "–" if r["batch_sharded_us"] is None else f"{r['batch_sharded_us']}"
                    # dearer than the gather: the cost rule leaves such steps to vLLM
                    ours = f"{r['commfold_us']}" + ("*" if r["saved_us"] < 0 else "")
                    cells.append(f"{r['gather_us']} / {b} / {ours}")
                lines.append(f"| {label} | {kind} | {c} | " + " | ".join(cells) + " |")
    floors = ["| shape | step floor TP=2, H100 / H200 (us) | TP=8, H100 / H200 (us) |",
              "|---|---|---|"]
    for shape in PARAMS:
        two, eight = by[(shape, "greedy", 1, 2)], by[(shape, "greedy", 1, 8)]
        floors.append(f"| {shape} | {two['floor_h100_us']} / {two['floor_h200_us']} | "
                      f"{eight['floor_h100_us']} / {eight['floor_h200_us']} |")
    return "\n".join(lines) + "\n\n" + "\n".join(floors) + "\n"


def main(argv=None) -> int:
    traffic = json.loads((OUT / "traffic_bytes.json").read_text())
    rows = estimate_rows(traffic)
    text = markdown(rows)
    (OUT / "gpu_estimate.md").write_text(text + "\n## Compact (docs/performance.md)\n\n"
                                         + compact(rows))
    print(text)
    print(compact(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
