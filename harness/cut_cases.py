"""vLLM's own top-k / top-p kernel against commfold's bounds of its cut, row by row, in
one process (tests of commfold.shard.bounds): a row set is masked by vLLM's
``apply_top_k_top_p`` (its Triton kernel in Triton's interpreter) and, split into
`world` vocab shards, bounded by ``_payload`` / ``_bounds`` as the ranks would (their
all-gather stood in by stacking the shards' payloads). Every row must keep every token
above ``keep`` and none below ``drop``; a row with a token between them on any shard
must be marked ``doubt``; and the kernel must cut a subset of the rows as it cuts
them in the whole set (what commfold.vllm.sample.shard_edge_rows rests on)."""
from __future__ import annotations

from types import SimpleNamespace

import torch


def rows_for(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [rows, vocab] float32, top_k [rows] int32, top_p [rows] float32): rows
    of the case's kind, scaled; bf16-rounded ones full of ties; some tokens -inf."""
    g = torch.Generator().manual_seed(case["seed"])
    rows, vocab = case["rows"], case["vocab"]
    if case["kind"] == "ties":
        x = torch.randint(-6, 7, (rows, vocab), generator=g).float()
    else:
        x = torch.randn(rows, vocab, generator=g)
        if case["kind"] == "peaked":
            x[:, torch.randint(0, vocab, (3,), generator=g)] += 4.0
    x = x * case["scale"]
    if case.get("bf16"):
        x = x.bfloat16().float()
    if case.get("masked"):
        x[torch.rand(rows, vocab, generator=g) < case["masked"]] = float("-inf")
    k = torch.randint(1, case["max_k"] + 1, (rows,), generator=g, dtype=torch.int32)
    k[torch.rand(rows, generator=g) < 0.3] = vocab  # top-k off
    p = torch.rand(rows, generator=g) * 0.9 + 0.1
    p[torch.rand(rows, generator=g) < 0.4] = 1.0  # top-p off
    return x, k, p


def kept_and_bounds(world: int, cases: list[dict]) -> list[dict]:
    """In a spawned rank (Triton's interpreter registered): per case, how many rows
    break the bounds, and how many each kind of answer has."""
    from harness import triton_cpu

    triton_cpu.install()
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from commfold.shard import bounds as cut

    out = []
    for case in cases:
        x, k, p = rows_for(case)
        vocab = x.shape[1]
        cut_rows = apply_top_k_top_p(x.clone(), k, p)
        kept = cut_rows > float("-inf")
        some = torch.arange(x.shape[0])[torch.arange(x.shape[0]) % 3 == case["seed"] % 3]
        alone = apply_top_k_top_p(x[some].clone(), k[some], p[some])
        subset_differs = not torch.equal(alone, cut_rows[some])
        shard = -(-vocab // case["world"])
        m, payloads = cut.candidates(k, p, vocab, shard), []
        for r in range(case["world"]):
            comm = SimpleNamespace(rank=lambda r=r: r)
            work = x[:, r * shard:min(vocab, (r + 1) * shard)]
            payloads.append(cut._payload(comm, work, m))
        if cut.refusal(k, vocab, shard) is not None:
            out.append(dict(case=case, refused=True, subset_differs=subset_differs))
            continue
        bounds = cut._bounds(torch.stack(payloads), m, k.long(), p.double(), vocab,
                             cut.block_size("cpu"))
        res = dict(case=case, refused=False, reason=bounds if isinstance(bounds, str)
                   else None, broken=[], exact=0, banded=0, whole=0,
                   subset_differs=subset_differs)
        if not isinstance(bounds, str):
            wide = x.double()
            for r in range(x.shape[0]):
                if not bool(bounds.rows[r]):
                    res["whole"] += 1
                    if not bool(kept[r][x[r] > float("-inf")].all()):
                        res["broken"].append((r, "a row left whole was cut"))
                    continue
                sure = wide[r] > bounds.keep[r]
                maybe = wide[r] >= bounds.drop[r]
                if bool((sure & ~kept[r]).any()) or bool((kept[r] & ~(sure | maybe)).any()):
                    res["broken"].append((r, int(k[r]), float(p[r])))
                band = maybe & ~sure
                res["exact" if not bool(band.any()) else "banded"] += 1
                if bool(band.any()) and not bool(bounds.doubt[r]):
                    res["broken"].append((r, "a token in doubt, the row not marked"))
        out.append(res)
    return out
