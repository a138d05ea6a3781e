"""Wall time of commfold's rewritten programs against plain Inductor's at a serving
shape, on 2 ranks sharing the device: the all_reduce + residual + RMSNorm of T=64
tokens of hidden 4096 (bf16), and the greedy pick over B=64 rows of Qwen's 151936-token
vocab (bf16, sharded over the 2 ranks: gather -> argmax, against per-rank argmax + a
gather of (value, index) pairs). Medians of interleaved repeats, the device
synchronized around each call, reported as plain / commfold (> 1: commfold faster);
results compared, rewrites asserted, no speed asserted. The collectives are gloo's,
which stage device tensors through host memory: the ratio shows what the rewrite saves
on that path, not what it saves over NCCL."""
from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commfold.cli.demo_model import gather_last_dim
from gpu_device import DEVICE, rank_device, requires_device, shard_of, synchronize

pytestmark = requires_device

TOKENS, HIDDEN, BATCH, VOCAB, REPEATS = 64, 4096, 64, 151936, 21


def norm_block(x, residual, weight):
    """A row-parallel layer's tail: all_reduce, + residual, Llama's RMSNorm."""
    h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
    hf = h.float()
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return n.to(h.dtype) * weight, h


def greedy_pick(shard):
    """The vocab-parallel LM head's greedy pick: gather the logits, argmax."""
    return gather_last_dim(shard, dist.group.WORLD)[:, :VOCAB].argmax(-1)


def _inputs(name, world, rank, dev):
    g = torch.Generator().manual_seed(1)
    if name == "allreduce_rmsnorm":
        xs = torch.randn(world, TOKENS, HIDDEN, generator=g).bfloat16()
        x = xs[rank].clone()  # its own storage on every device, as .to("cuda") gives
        return (x.to(dev), torch.randn(TOKENS, HIDDEN, generator=g).bfloat16().to(dev),
                (1 + 0.1 * torch.randn(HIDDEN, generator=g)).bfloat16().to(dev))
    logits = (torch.randn(BATCH, VOCAB, generator=g) * 4).bfloat16()
    return (shard_of(logits, world, rank).to(dev),)


PROGRAMS = {"allreduce_rmsnorm": (norm_block, ("fuse_allreduce_rmsnorm",)),
            "greedy_pick": (greedy_pick, ("local_argmax",))}


def _same(name, a, b) -> bool:
    if name == "greedy_pick":
        return torch.equal(a, b)
    (out_a, h_a), (out_b, h_b) = a, b
    return torch.equal(h_a, h_b) and torch.allclose(out_a.float(), out_b.float(), rtol=2**-7,
                                                    atol=2**-7)


def timed_on_rank(device: str, name: str) -> dict:
    import commfold

    dev = rank_device(device)
    fn, passes = PROGRAMS[name]
    args = _inputs(name, dist.get_world_size(), dist.get_rank(), dev)
    commfold.clear_reports()
    programs = {"plain": torch.compile(fn, backend="inductor"),
                "commfold": torch.compile(fn, backend=commfold.backend(
                    passes=passes, fuse_cost_rule=False))}  # the op timed, not the rule
    ms = {k: [] for k in programs}
    with torch.no_grad():
        results = {k: p(*args) for k, p in programs.items()}  # compile, warm up
        for i in range(REPEATS):
            for k in (list(programs) if i % 2 == 0 else list(programs)[::-1]):
                synchronize(dev)
                dist.barrier()
                t = time.perf_counter()
                programs[k](*args)
                synchronize(dev)
                ms[k].append((time.perf_counter() - t) * 1e3)
    return {"ms": {k: statistics.median(v) for k, v in ms.items()},
            "rewrites": sum(r.count(passes[0]) for r in commfold.reports()),
            "same": _same(name, results["commfold"], results["plain"])}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_wall_time(gpu_ranks, record_property, name):
    results = gpu_ranks.run(timed_on_rank, DEVICE, name)
    ms = results[0]["ms"]
    shape = f"T={TOKENS} H={HIDDEN}" if name == "allreduce_rmsnorm" else f"B={BATCH} V={VOCAB}"
    record_property("numbers", f"{shape} bf16: plain {ms['plain']:.3f} ms, commfold "
                               f"{ms['commfold']:.3f} ms -> {ms['plain'] / ms['commfold']:.2f}x "
                               f"(median of {REPEATS}, rank 0)")
    for r in results:
        assert r["rewrites"] > 0, f"{PROGRAMS[name][1][0]} rewrote nothing"
        assert r["same"], "results differ from Inductor's"
