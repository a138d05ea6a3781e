"""The same kind of decoder as tp_decoder_funcol.py, written as a plain single-device
nn.Module and parallelized with DTensor (torch.distributed.tensor.parallel):
ColwiseParallel / RowwiseParallel for attention and MLP, a RowwiseParallel
(vocab-parallel) embedding and a ColwiseParallel LM head whose vocab-sharded logits
are gathered (Replicate) before the argmax. DTensor emits the collectives; commfold
finds them in the compiled graph like any others.

    python -m examples.tp_decoder_dtensor                   # spawns 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 -m examples.tp_decoder_dtensor
    commfold diff examples/tp_decoder_dtensor.py
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from commfold.cli.demo_model import greedy_decode, greedy_vs_inductor, show_comparison
from commfold.distributed.ranks import run_here_or_spawn

VOCAB, HIDDEN, LAYERS, HEADS, FFN = 1000, 64, 2, 4, 128
BATCH, SEQ, STEPS = 4, 8, 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(1.0 + 0.1 * torch.randn(dim)), eps

    def forward(self, x):
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(dtype) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))
        self.head_dim = HIDDEN // HEADS

    def forward(self, x):
        b, s, _ = x.shape  # after ColwiseParallel each rank holds HEADS / world heads
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(HIDDEN, FFN, bias=False), nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.attn_norm = Attention(), RMSNorm(HIDDEN)
        self.mlp, self.mlp_norm = MLP(), RMSNorm(HIDDEN)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.input_norm = RMSNorm(HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        residual = self.embed(ids)
        h = self.input_norm(residual)
        for layer in self.layers:
            residual = layer.attn(h) + residual
            h = layer.attn_norm(residual)
            residual = layer.mlp(h) + residual
            h = layer.mlp_norm(residual)
        return self.lm_head(h[:, -1]).argmax(dim=-1)


def parallelize(model: Decoder, world: int) -> Decoder:
    mesh = init_device_mesh("cpu", (world,))
    plan = {"embed": RowwiseParallel(input_layouts=Replicate()),  # vocab-parallel lookup
            "lm_head": ColwiseParallel(output_layouts=Replicate())}  # shard vocab, gather
    for i in range(LAYERS):
        plan.update({f"layers.{i}.attn.{p}": ColwiseParallel() for p in "qkv"})
        plan.update({f"layers.{i}.mlp.{p}": ColwiseParallel() for p in ("gate", "up")})
        plan[f"layers.{i}.attn.o"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.down"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def main() -> dict:
    """One rank's work (its process group is initialized)."""
    torch.manual_seed(0)  # same full weights on every rank before sharding
    model = parallelize(Decoder().requires_grad_(False), dist.get_world_size())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return greedy_vs_inductor(lambda step, x: greedy_decode(step, x, STEPS), model, ids)


if __name__ == "__main__":
    show_comparison(run_here_or_spawn(main))
