"""commfold's layer ops on the device, on 2 ranks: allreduce_rmsnorm (the residual
written back bit-equal to the unfused math on CPU tensors, the normed output within 4
ulps of it and 8 ulps of float64 math; f32 / bf16 / fp16, with and without residual,
Gemma's 1 + w, each rounding flag) and which path it took (FlashInfer or composite);
replicated_embedding bit-identical to the masked lookup + all_reduce it replaces,
replicated_lm_head within float32 matmul rounding of the matmul + all_gather. No C++
CPU kernel is built for the references (a GPU machine need not have a compiler)."""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from gpu_device import DEVICE, rank_device, requires_device, same_bits, ulp, world_comm

pytestmark = requires_device

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENS, HIDDEN, EPS = 7, 256, 1e-6


def _norm_cases():
    """(dtype, residual, weight offset, flags) - every dtype and flag, one at a time."""
    from commfold.ops.norm_flags import pack_flags

    flag_sets = [pack_flags(), pack_flags(round_before_weight=True), pack_flags(round_sum=True),
                 pack_flags(offset_in_weight_dtype=True)]
    for dtype, residual, flags in itertools.product(DTYPES, (False, True), flag_sets):
        yield dtype, residual, 1.0 if flags & 1 else 0.0, flags


def _exact(xs, res, w, offset):
    """float64 RMSNorm(sum of every rank's x (+ residual)) * (w + offset)."""
    h = xs.double().sum(0) + (res.double() if res is not None else 0)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (w.double() + offset)


def _composite(xs, res, w, offset, flags, comm):
    """The unfused math on CPU tensors, no C++ kernel: the sum all-reduce (gloo), then
    composite_add_norm (the reference the CPU kernel is tested against). Returns
    (normed, new residual)."""
    from commfold.distributed.collectives import communicator
    from commfold.ops.allreduce_rmsnorm import composite_add_norm, out_dtype_of
    from commfold.ops.norm_flags import OFFSET_IN_WEIGHT_DTYPE, ROUND_BEFORE_WEIGHT, ROUND_SUM

    h = communicator(comm).all_reduce(xs[dist.get_rank()])
    wf = ((w + offset) if flags & OFFSET_IN_WEIGHT_DTYPE else w.float() + offset).float()
    out = composite_add_norm(h, res, wf, EPS, bool(flags & ROUND_BEFORE_WEIGHT),
                             bool(flags & ROUND_SUM), out_dtype_of(xs, flags))
    return out, h


def norm_op_on_rank(device: str) -> dict:
    from commfold.distributed.collectives import communicator
    from commfold.ops import flashinfer_norm
    from commfold.ops.allreduce_rmsnorm import out_dtype_of

    dev = rank_device(device)
    world, rank, comm = dist.get_world_size(), dist.get_rank(), world_comm()
    op = torch.ops.commfold.allreduce_rmsnorm.default
    bad, worst_ulps, n = [], 0.0, 0
    for n, (dtype, residual, offset, flags) in enumerate(_norm_cases(), 1):
        g = torch.Generator().manual_seed(n)
        xs = torch.randn(world, TOKENS, HIDDEN, generator=g).to(dtype)
        res = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype) if residual else None
        w = (torch.randn(HIDDEN, generator=g) * 0.5 + 1 - offset).to(dtype)
        x = xs[rank].clone().to(dev)  # the op writes the new residual into it
        out = op(x, None if res is None else res.to(dev), w.to(dev), EPS, offset, flags,
                 comm).cpu()
        want, want_res = _composite(xs, res, w, offset, flags, comm)
        exact = _exact(xs, res, w, offset)
        err = ((out.double() - exact).abs() / exact.abs().clamp_min(1.0)).max().item()
        worst_ulps = max(worst_ulps, err / ulp(out_dtype_of(xs, flags)))
        tol = 4 * ulp(dtype)
        checks = {"residual written back": same_bits(x, want_res),
                  "normed output vs composite on CPU": torch.allclose(
                      out.double(), want.double(), rtol=tol, atol=tol),
                  "normed output vs float64": err <= 8 * ulp(dtype)}
        bad += [(name, str(dtype), residual, offset, flags)
                for name, ok in checks.items() if not ok]
    probe = torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16, device=dev)
    why = flashinfer_norm.why_not(probe, None, 0.0, False, False, probe.dtype,
                                  communicator(comm))
    return {"bad": bad, "cases": n, "worst_ulps": worst_ulps,
            "path": "FlashInfer" if why is None else f"composite ({why})"}


def test_allreduce_rmsnorm(gpu_ranks, record_property):
    results = gpu_ranks.run(norm_op_on_rank, DEVICE)
    bad = [b for r in results for b in r["bad"]]
    r0 = results[0]
    record_property("numbers", f"{r0['cases']} cases x {len(results)} ranks, {len(bad)} "
                               f"mismatches; worst {r0['worst_ulps']:.1f} ulp from float64; "
                               f"path: {r0['path']}")
    assert bad == [], bad[:3]


def replicated_ops_on_rank(device: str) -> dict:
    from commfold.ops.replicate import replicated_embedding, replicated_lm_head

    dev = rank_device(device)
    world, rank, comm = dist.get_world_size(), dist.get_rank(), world_comm()
    group = dist.group.WORLD
    vocab, hidden = 1001, 64
    vs = -(-vocab // world)
    g = torch.Generator().manual_seed(3)
    bad, max_rel = [], 0.0
    for dtype in DTYPES:
        full = torch.randn(world * vs, hidden, generator=g).to(dtype)
        full[vocab:] = 0  # padding rows
        shard = full[rank * vs:(rank + 1) * vs].to(dev)
        ids = torch.cat([torch.randint(0, vocab, (13,), generator=g),
                         torch.tensor([0, vs - 1, vs, vocab - 1, -1, vocab + 5])]).to(dev)
        lo, hi = rank * vs, min((rank + 1) * vs, vocab)
        outside = (ids < lo) | (ids >= hi)
        looked = F.embedding((ids - lo).masked_fill(outside, 0), shard)
        want = funcol.all_reduce(looked.masked_fill(outside[:, None], 0), "sum", group)
        got = replicated_embedding(ids, shard, [lo, hi, 0], world, comm)
        if not same_bits(got, want):
            bad.append(("embedding", str(dtype)))
        h = torch.randn(5, hidden, generator=g).to(dtype).to(dev)
        gathered = funcol.all_gather_tensor(h @ shard.t(), 1, group)[:, :vocab]
        logits = replicated_lm_head(h, shard, vocab, world, comm)
        rel = ((logits.double() - gathered.double()).abs().max()
               / gathered.double().abs().max()).item()
        max_rel = max(max_rel, rel)
        if logits.shape != gathered.shape or rel > 4 * ulp(dtype):
            bad.append(("lm_head", str(dtype), rel))
    return {"bad": bad, "max_rel": max_rel}


def test_replicated_embedding_and_lm_head(gpu_ranks, record_property):
    results = gpu_ranks.run(replicated_ops_on_rank, DEVICE)
    bad = [b for r in results for b in r["bad"]]
    record_property("numbers", f"embedding + LM head x 3 dtypes x {len(results)} ranks, "
                               f"{len(bad)} mismatches; LM head max rel. diff "
                               f"{max(r['max_rel'] for r in results):.1e}")
    assert bad == [], bad[:3]
