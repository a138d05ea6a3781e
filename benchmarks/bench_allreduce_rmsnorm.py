"""fuse_allreduce_rmsnorm: fused vs unfused all_reduce -> residual add -> RMSNorm,
both Inductor-compiled, on gloo ranks of this machine (default TP=2).

    python -m benchmarks.bench_allreduce_rmsnorm                 # full grid
    python -m benchmarks.bench_allreduce_rmsnorm --tokens 1 16 --hidden 1024 --rounds 20
    python -m benchmarks.bench_allreduce_rmsnorm --comm vllm-shm     # vLLM CPU's all-reduce

For each (dtype, H) one compile per variant (token count dynamic), plus a control:
the unfused program compiled again (A/A; its ratio is the noise floor). A single call at
small sizes is one latency-bound gloo all-reduce whose time scatters by +-30% on a
shared CPU, so calls are timed in rounds (harness.bench.paired_rounds):
each round runs a short block of back-to-back calls of each variant, order swapped
every other round, slowest rank's time. The table shows the median per call and the
median over rounds of the per-round ratio unfused/fused (> 1: fused is faster), with
its quartiles.
``--two-shot`` adds the forced two-shot variant (reduce_scatter + all_gathers): the
measurement behind the default size rule (off on gloo). The fusion keeps the
communication (one all-reduce of T x H values): its lower bound is the unfused one.
``measure`` is the rank-side function the suite (``python -m benchmarks``) runs.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import commfold
from commfold.distributed.ranks import run_on_ranks
from harness.bench import comm_of_variants, paired_ratio, paired_rounds


def block(x, r, w):
    h = funcol.all_reduce(x, "sum", dist.group.WORLD) + r
    return F.rms_norm(h, (h.shape[-1],), w, 1e-6), h


_SHM = {}  # {"handle": int} once vLLM's TP group is up (--comm vllm-shm)


def block_vllm_shm(x, r, w):
    """As vLLM CPU's graphs: the shared-memory all-reduce in place on an intermediate
    (a projection's output there; x * 2 here), then the add and the norm."""
    y = x * 2
    torch.ops._C.shm_allreduce(_SHM["handle"], y)
    h = y + r
    return F.rms_norm(h, (h.shape[-1],), w, 1e-6), h


_BLOCKS = {"gloo": block, "vllm-shm": block_vllm_shm}


def _compiled(backend, fn=block):
    return torch.compile(lambda x, r, w: fn(x, r, w), backend=backend)


def _variants(two_shot: bool, fn=block) -> dict:
    """unfused, fused, and "control": the unfused program compiled a second time, an
    A/A pair whose ratio shows how far this machine's noise alone moves a median."""
    v = {"unfused": _compiled("inductor", fn),
         "fused": _compiled(commfold.backend(passes=("fuse_allreduce_rmsnorm",),
                                             fuse_cost_rule=False), fn),  # the rule's input
         "control": _compiled("inductor", fn)}
    if two_shot:
        v["two-shot"] = _compiled(commfold.backend(
            passes=("fuse_allreduce_rmsnorm",), two_shot_min_bytes=0, fuse_cost_rule=False), fn)
    return v


def measure(dtypes, hiddens, tokens, rounds, two_shot=False, comm="gloo") -> list[dict]:
    """On every rank: one row per (dtype, T, H): median seconds per call of each
    variant, the paired ratio unfused/fused (median, quartiles over `rounds` rounds),
    max |fused - unfused| of the normed output, communication per call.
    comm="vllm-shm": vLLM's TP group and its shared-memory all-reduce instead."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fn = _BLOCKS[comm]
    if comm == "vllm-shm":
        from harness.vllm_tp import init_vllm_tp, shm_handle

        _SHM["handle"] = shm_handle(init_vllm_tp(world, shm=True))
        torch._inductor.config.enable_auto_functionalized_v2 = False  # as vLLM sets it
    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for hidden in hiddens:
            torch._dynamo.reset()
            variants = _variants(two_shot, fn)
            w = torch.ones(hidden, dtype=dtype)
            for t in tokens:
                x = torch.randn(t, hidden, dtype=dtype) + rank
                r = torch.randn(t, hidden, dtype=dtype)
                for a in (x, r):
                    torch._dynamo.maybe_mark_dynamic(a, 0)
                out = {k: f(x, r, w)[0] for k, f in variants.items()}
                diff = (float((out["fused"].float() - out["unfused"].float()).abs().max())
                        if t else 0.0)
                times = paired_rounds(variants, (x, r, w), rounds, warmup=2)
                sent = comm_of_variants(variants, (x, r, w))
                sent["bound"] = {"bytes": t * hidden * x.element_size(), "calls": 1}
                rows.append({"baseline": "unfused", "rewritten": "fused",
                             "world": world, "dtype": dname, "T": t, "H": hidden,
                             **{f"{k}_s": statistics.median(v) for k, v in times.items()},
                             "ratio": {k: paired_ratio(times, "unfused", k)
                                       for k in times if k != "unfused"},
                             "max_abs_diff": diff, "comm": sent})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--two-shot", action="store_true")
    p.add_argument("--comm", choices=sorted(_BLOCKS), default="gloo",
                   help="vllm-shm: vLLM CPU's shared-memory all-reduce (needs vLLM)")
    a = p.parse_args(argv)
    rows = run_on_ranks(measure, a.world, a.dtypes, a.hidden, a.tokens, a.rounds,
                        a.two_shot, a.comm, timeout=3600)[0]
    names = ["unfused", "fused", "control"] + (["two-shot"] if a.two_shot else [])
    print(f"TP={a.world}, {a.comm}, {a.rounds} rounds (rank 0); x: median over rounds of "
          f"unfused/variant [quartiles]")
    print(f"{'dtype':9} {'T':>5} {'H':>5} " + " ".join(f"{n + ' ms':>12}" for n in names)
          + "".join(f" {'unfused/' + n:>26}" for n in names[1:]))
    for r in rows:
        line = f"{r['dtype']:9} {r['T']:>5} {r['H']:>5} " \
            + " ".join(f"{r[n + '_s'] * 1e3:>12.3f}" for n in names)
        for n in names[1:]:
            q = r["ratio"][n]
            line += f" {q['median']:>8.2f}x [{q['q1']:.2f}-{q['q3']:.2f}]".rjust(27)
        print(line)

if __name__ == "__main__":
    main()
