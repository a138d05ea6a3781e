"""commfold.ops.local_logprobs (vLLM's logprobs without the full-vocab gather) on the
device, on 2 ranks, against log_softmax over the whole row on CPU: the token (greedy
or scored), its logprob and rank, and the top-k logprobs with the ids they belong to
(checked by value, so ties among bf16 logits may come in any order). Off the CPU
with commfold's C++ vocab scans off (the scans are CPU code: a GPU machine builds
none of them here)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_device import (DEVICE, no_cpp_build_off_cpu, rank_device, requires_device, shard_of,
                        world_comm)

pytestmark = requires_device

# (rows, vocab, dtype, k, scored, seed): Qwen's vocab (151936) and an odd one (padding)
CASES = [(4, 151936, torch.float32, 5, False, 1), (4, 151936, torch.bfloat16, 20, True, 2),
         (3, 3001, torch.float32, 0, True, 3), (5, 3001, torch.bfloat16, 1, False, 4)]


def _fallback(whole: list):
    """vLLM's code for rows done whole: the rule on the gathered rows."""
    def run(full, tokens, k):
        whole.append(len(tokens))
        lp = torch.log_softmax(full.float(), -1)
        lp_t = lp.gather(1, tokens[:, None])
        top = torch.topk(lp, k)
        return (torch.cat([tokens[:, None], top.indices], 1), torch.cat([lp_t, top.values], 1),
                (lp >= lp_t).sum(-1))
    return run


def logprobs_on_rank(device: str) -> dict:
    from commfold.ops.local_logprobs import local_logprobs

    dev = rank_device(device)
    world, rank, comm = dist.get_world_size(), dist.get_rank(), world_comm()
    bad, whole = [], []
    for rows, vocab, dtype, k, scored, seed in CASES:
        g = torch.Generator().manual_seed(seed)
        full = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        vs = -(-vocab // world)
        padded = torch.nn.functional.pad(full.float(), (0, world * vs - vocab), value=1e4)
        shard = shard_of(padded.to(dtype), world, rank).to(dev)
        targets = torch.randint(0, vocab, (rows,), generator=g) if scored else None
        with no_cpp_build_off_cpu(dev):
            tokens, ids, lps, ranks = local_logprobs(
                shard, vocab, comm, k, _fallback(whole),
                None if targets is None else targets.to(dev))
        lp = torch.log_softmax(full.float(), -1)
        want_t = full.float().argmax(-1) if targets is None else targets
        lp_t = lp.gather(1, want_t[:, None])
        ids, lps = ids.cpu().long(), lps.cpu().float()
        checks = {
            "token": torch.equal(tokens.cpu().long(), want_t),
            "rank": torch.equal(ranks.cpu().long(), (lp >= lp_t).sum(-1)),
            "logprobs": torch.allclose(lps, torch.cat([lp_t, torch.topk(lp, k).values], 1),
                                       rtol=1e-5, atol=1e-5),
            "ids hold their logprobs": torch.allclose(lp.gather(1, ids), lps, rtol=1e-5,
                                                      atol=1e-5),
        }
        bad += [(name, rows, vocab, str(dtype), k, scored) for name, ok in checks.items()
                if not ok]
    return {"bad": bad, "whole_rows": sum(whole)}


def test_local_logprobs(gpu_ranks, record_property):
    results = gpu_ranks.run(logprobs_on_rank, DEVICE)
    bad = [b for r in results for b in r["bad"]]
    record_property("numbers", f"{len(CASES)} cases x {len(results)} ranks, {len(bad)} "
                               f"mismatches, {results[0]['whole_rows']} rows gathered whole")
    assert bad == [], bad[:3]
