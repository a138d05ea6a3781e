"""Hand-written tensor-parallel decoder tails, as people write TP by hand (written
here from the forms such projects use, not copied): a row-parallel projection whose
partial sums are all-reduced, the residual add, the next RMSNorm. Each spelling is a
small nn.Module built from three knobs, so tests/test_tp_spellings.py runs the whole
corpus in one rank-pool call:

- ``reduce``: how the projection's output is all-reduced
  - ``hook``: a forward hook on the projection returns
    ``funcol.all_reduce(output, "sum", list(range(world)))`` (a rank-list group)
  - ``hook_batch0``: the hook all-reduces ``output[0]`` ([1, T, H] -> [T, H]: the
    batch dim dropped), which the residual add broadcasts against [1, T, H]
  - ``inplace``: ``dist.all_reduce(out)`` inside the projection's forward
  - ``megatron``: a ``torch.autograd.Function`` region (forward all-reduce, backward
    identity), called as ``reduce_from_tensor_model_parallel_region(out)``
  - ``dtensor``: ``parallelize_module`` with ``ColwiseParallel`` on an up projection
    and ``RowwiseParallel(output_layouts=Replicate())`` on the down projection
  - ``max``: a max all-reduce (not a sum)
- ``add``: how the reduced value meets the residual stream ([1, T, H])
  - ``res_first`` / ``out_first``: ``r + out`` / ``out + r``
  - ``unsqueeze``, ``index_none``, ``reshape``, ``view``: a view adding the leading 1
    between the all-reduce and the add (``out.unsqueeze(0)``, ``out[None]``,
    ``out.reshape(1, T, H)``, ``out.view(r.shape)``)
  - ``f32_stream``: a float32 residual stream, ``r + out.float()``
  - ``repeat``: the residual is [2, T, H] (a true broadcast)
  - ``view_mid``: ``out.view(T, 1, H)`` added to a [T, 1, H] residual (not a leading 1)
  - ``mixed``: ``out + r`` with r float32 and out bf16 (type promotion, no cast)
  - ``also_read``: ``out + r``, and ``out`` returned as well (another consumer)
  - ``scaled_also_read``: ``out * 0.5 + r``, and ``out`` returned as well
- ``norm``: the RMSNorm after the add
  - ``typeas_before``: ``self._norm(h.float()).type_as(h) * w`` (cast back, then weight)
  - ``typeas_after``: ``(self._norm(h.float()) * w.float()).type_as(h)``
  - ``to_before``: ``w * n.to(dtype)``, the square spelled ``x * x``
  - ``functional``: ``F.rms_norm``
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

K, H, EPS = 32, 48, 1e-6
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
VIEWS_BACK = ("unsqueeze", "index_none", "reshape", "view")  # views adding the leading 1


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's region: the forward all-reduces, the backward passes the gradient."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def reduce_from_tensor_model_parallel_region(x):
    return _ReduceFromRegion.apply(x)


class RowParallel(nn.Module):
    """A projection holding this rank's rows: its output is a partial sum."""

    def __init__(self, reduce: str, dtype):
        super().__init__()
        self.reduce = reduce
        self.proj = nn.Linear(K, H, bias=False, dtype=dtype)
        world = dist.get_world_size()
        if reduce == "hook":
            self.proj.register_forward_hook(
                lambda _m, _i, out: funcol.all_reduce(out, "sum", list(range(world))))
        elif reduce == "hook_batch0":
            self.proj.register_forward_hook(
                lambda _m, _i, out: funcol.all_reduce(out[0], "sum", list(range(world))))

    def forward(self, x):
        out = self.proj(x)
        if self.reduce == "inplace":
            dist.all_reduce(out)
        elif self.reduce == "max":
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
        elif self.reduce == "megatron":
            out = reduce_from_tensor_model_parallel_region(out)
        return out


class ColRow(nn.Module):
    """An MLP whose up projection is column-parallel and down row-parallel (DTensor)."""

    def __init__(self, dtype):
        super().__init__()
        self.up = nn.Linear(K, 2 * K, bias=False, dtype=dtype)
        self.down = nn.Linear(2 * K, H, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class RMSNorm(nn.Module):
    def __init__(self, how: str, dtype):
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(torch.randn(H, dtype=dtype) * 0.5 + 1)

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + EPS)

    def forward(self, h):
        if self.how == "typeas_before":
            return self._norm(h.float()).type_as(h) * self.weight
        if self.how == "typeas_after":
            return (self._norm(h.float()) * self.weight.float()).type_as(h)
        if self.how == "to_before":
            hf = h.float()
            n = hf * torch.rsqrt((hf * hf).mean(-1, keepdim=True) + EPS)
            return self.weight * n.to(h.dtype)
        if self.how == "functional":
            return F.rms_norm(h, (H,), self.weight, EPS)
        raise ValueError(self.how)


class Tail(nn.Module):
    """x -> row-parallel projection, all-reduced -> residual add -> RMSNorm.
    Returns (normed, new residual) (and the reduced value where ``add`` asks)."""

    def __init__(self, reduce: str, add: str, norm: str, dtype):
        super().__init__()
        self.add = add
        if reduce == "dtensor":
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)

            from harness.fuzz_programs import mesh

            self.layer: nn.Module = parallelize_module(ColRow(dtype), mesh(), {
                "up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Replicate())})
        else:
            self.layer = RowParallel(reduce, dtype)
        self.norm = RMSNorm(norm, dtype)

    def forward(self, x, r):
        out = self.layer(x)
        add = self.add
        if add == "res_first":
            h = r + out
        elif add in ("out_first", "mixed", "also_read", "repeat"):
            h = out + r
        elif add == "unsqueeze":
            h = out.unsqueeze(0) + r
        elif add == "index_none":
            h = r + out[None]
        elif add == "reshape":
            h = out.reshape(1, -1, H) + r
        elif add == "view":
            h = r + out.view(r.shape)
        elif add == "f32_stream":
            h = r + out.float()
        elif add == "view_mid":
            h = out.reshape(-1, 1, H) + r
        elif add == "scaled_also_read":
            h = out * 0.5 + r
        else:
            raise ValueError(add)
        normed = self.norm(h)
        return (normed, h, out) if add in ("also_read", "scaled_also_read") else (normed, h)


def inputs(reduce: str, add: str, dtype, tokens: int, rank: int) -> tuple:
    """This rank's (x, residual): x [1, T, K] (the batch of one a decoder runs; [T, K]
    where a view adds the leading 1 back, or the residual has none), the residual
    [1, T, H] (or what ``add`` asks for); T marked dynamic."""
    g = torch.Generator().manual_seed(1000 * rank + tokens)
    flat = add in VIEWS_BACK + ("view_mid",) and reduce != "hook_batch0"
    x = torch.randn(*(() if flat else (1,)), tokens, K, generator=g).to(dtype)
    r_shape = {"repeat": (2, tokens, H), "view_mid": (tokens, 1, H)}.get(add, (1, tokens, H))
    r_dtype = torch.float32 if add in ("f32_stream", "mixed") else dtype
    r = torch.randn(*r_shape, generator=g).to(r_dtype)
    torch._dynamo.maybe_mark_dynamic(x, x.dim() - 2)
    torch._dynamo.maybe_mark_dynamic(r, 0 if add == "view_mid" else 1)
    return x, r


def model(reduce: str, add: str, norm: str, dtype) -> nn.Module:
    """The same weights on every rank and for every backend (each rank's partial sum
    still differs: its input does)."""
    torch.manual_seed(7)
    return Tail(reduce, add, norm, dtype).eval()


class Corpus(nn.Module):
    """Every spelling of a table in one module (``tails.<name>``), so one compile covers
    the corpus: each site's rewrite or near-miss names its tail in its source location
    (commfold.report.module_path)."""

    def __init__(self, specs: dict[str, tuple[str, str, str, str]]):
        super().__init__()
        self.names = list(specs)
        self.tails = nn.ModuleDict({n: model(*s[:3], DTYPES[s[3]]) for n, s in specs.items()})

    def forward(self, *flat):
        return [self.tails[n](flat[2 * i], flat[2 * i + 1]) for i, n in enumerate(self.names)]


def corpus_inputs(specs: dict[str, tuple[str, str, str, str]], tokens: int, rank: int) -> list:
    return [t for s in specs.values() for t in inputs(s[0], s[1], DTYPES[s[3]], tokens, rank)]
