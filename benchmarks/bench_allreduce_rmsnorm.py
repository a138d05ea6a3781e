"""fuse_allreduce_rmsnorm: fused vs unfused all_reduce -> residual add -> RMSNorm,
both Inductor-compiled, on gloo ranks of this machine (default TP=2).

    python benchmarks/bench_allreduce_rmsnorm.py                 # full grid
    python benchmarks/bench_allreduce_rmsnorm.py --tokens 1 16 --hidden 1024 --iters 20

For each (dtype, H) one compile per variant (token count dynamic); calls alternate
between the variants, every call starts after a barrier, and the table shows the
median per call on rank 0 and the ratio unfused/fused (> 1: fused is faster); the
ratio of the fastest calls is printed too (less sensitive to a busy machine).
``--two-shot`` adds the forced two-shot variant (reduce_scatter + all_gathers): the
measurement behind the default size rule (off on gloo).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import commfold
from commfold.testing import run_on_ranks


def block(x, r, w):
    h = funcol.all_reduce(x, "sum", dist.group.WORLD) + r
    return F.rms_norm(h, (h.shape[-1],), w, 1e-6), h


def _variants(two_shot: bool) -> dict:
    v = {"unfused": torch.compile(block, backend="inductor"),
         "fused": torch.compile(lambda x, r, w: block(x, r, w),
                                backend=commfold.backend(passes=("fuse_allreduce_rmsnorm",)))}
    if two_shot:
        v["two-shot"] = torch.compile(
            lambda x, r, w: block(x, r, w),
            backend=commfold.backend(passes=("fuse_allreduce_rmsnorm",),
                                     extra=(("allreduce_rmsnorm_two_shot_min_bytes", "0"),)))
    return v


def bench_on_rank(dtypes, hiddens, tokens, iters, two_shot):
    rank = dist.get_rank()
    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for hidden in hiddens:
            torch._dynamo.reset()
            variants = _variants(two_shot)
            w = torch.ones(hidden, dtype=dtype)
            for t in tokens:
                x = torch.randn(t, hidden, dtype=dtype) + rank
                r = torch.randn(t, hidden, dtype=dtype)
                for a in (x, r):
                    torch._dynamo.maybe_mark_dynamic(a, 0)
                times = {k: [] for k in variants}
                for _ in range(2):  # warm-up (compiles on first use)
                    for fn in variants.values():
                        fn(x, r, w)
                for _ in range(iters):
                    for name, fn in variants.items():
                        dist.barrier()
                        t0 = time.perf_counter()
                        fn(x, r, w)
                        times[name].append(time.perf_counter() - t0)
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                best = {k: min(v) * 1e3 for k, v in times.items()}
                rows.append((dname, t, hidden, med, best))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--two-shot", action="store_true")
    a = p.parse_args()
    rows = run_on_ranks(bench_on_rank, a.world, a.dtypes, a.hidden, a.tokens, a.iters,
                        a.two_shot, timeout=3600)[0]
    names = list(rows[0][3])
    head = f"{'dtype':9} {'T':>5} {'H':>5} " + " ".join(f"{n + ' ms':>12}" for n in names) \
        + f" {'unfused/fused':>14} {'(of minima)':>12}"
    if a.two_shot:
        head += f" {'unfused/2shot':>14}"
    print(f"TP={a.world}, gloo, {torch.get_num_threads()} threads in this process, "
          f"median of {a.iters} calls each (rank 0)")
    print(head)
    for dname, t, hidden, med, best in rows:
        line = f"{dname:9} {t:>5} {hidden:>5} " + " ".join(f"{med[n]:>12.3f}" for n in names)
        line += f" {med['unfused'] / med['fused']:>13.2f}x"
        line += f" {best['unfused'] / best['fused']:>11.2f}x"
        if a.two_shot:
            line += f" {med['unfused'] / med['two-shot']:>13.2f}x"
        print(line)


if __name__ == "__main__":
    main()
