"""Decoder layers inside torch.compiler.nested_compile_region (invoke_subgraph): Inductor
compiles the region's body as a graph of its own and runs commfold's pass on it, so a
layer's all-reduce -> residual add -> RMSNorm is fused once and reused by every call,
with the same values as plain Inductor on 2 gloo ranks. torch 2.14 functionalizes a
region's mutating ops as auto_functionalized_v2 regardless of Inductor's setting; the
v1/v2 spellings themselves are test_recognize_norms.py's and
test_recognize_collectives.py's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfold

H, T, LAYERS = 64, 5, 3


def _decoder(in_place: bool):
    """LAYERS layers in one nested region; in_place: the region adds the reduced value
    into the residual it was passed (a mutated region input, as vLLM's layers do)."""
    g = torch.Generator().manual_seed(1)
    weights = [(torch.randn(H, H, generator=g) / H ** 0.5, torch.randn(H, generator=g))
               for _ in range(LAYERS)]

    def norm(s, w_norm):
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w_norm

    @torch.compiler.nested_compile_region
    def layer(x, r, w_proj, w_norm):
        s = funcol.all_reduce(x @ w_proj, "sum", dist.group.WORLD) + r
        return norm(s, w_norm), s

    @torch.compiler.nested_compile_region
    def layer_in_place(x, r, w_proj, w_norm):
        r.add_(funcol.all_reduce(x @ w_proj, "sum", dist.group.WORLD))
        return norm(r, w_norm)  # a region may not return an alias of its input

    def decoder(x, r):
        for w_proj, w_norm in weights:
            if in_place:
                x = layer_in_place(x, r, w_proj, w_norm)
            else:
                x, r = layer(x, r, w_proj, w_norm)
        return x, r

    return decoder


def nested_on_rank(in_place):
    torch.manual_seed(dist.get_rank())
    x, r = torch.randn(T, H), torch.randn(T, H)
    decoder = _decoder(in_place)
    torch._dynamo.reset()
    plain = torch.compile(decoder, backend="inductor")(x, r.clone())  # r: mutated
    torch._dynamo.reset()
    commfold.clear_reports()
    fused = torch.compile(decoder, backend=commfold.backend(
        passes=("fuse_allreduce_rmsnorm",), strict=True))(x, r.clone())
    rewrites = sum(rep.count("fuse_allreduce_rmsnorm") for rep in commfold.reports())
    diff = max((a - b).abs().max().item() for a, b in zip(plain, fused))
    return rewrites, diff


@pytest.mark.parametrize("in_place", [False, True], ids=["returned", "in_place"])
def test_layers_in_nested_regions_are_fused(ranks2, in_place):
    for rewrites, diff in ranks2.run(nested_on_rank, in_place):
        assert rewrites == 1  # the region's body, compiled once for every layer
        assert diff <= 1e-5
