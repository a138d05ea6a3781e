"""A small tensor-parallel decoder in plain torch with functional collectives: the
model the demo, the examples and the CLI tests compile.

Written the way TP inference code is usually written, so every commfold pass finds
its pattern without the model knowing about commfold:

- vocab-parallel embedding: mask ids outside this rank's vocab range, offset them,
  look up the local shard, zero the masked rows, all_reduce;
- per layer, attention (column-sharded heads) and a SwiGLU MLP (column/row sharded),
  each ending in all_reduce -> add residual -> hand-written Llama RMSNorm;
- vocab-parallel LM head: matmul with the local vocab shard, all_gather on the last
  dim, slice to the valid vocab (the vocab is padded to a multiple of the world
  size), argmax (greedy pick).

Every rank builds the same full weights from a seed and keeps its shard, so results
do not depend on the world size except through floating-point summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x concatenated along the last dim, in rank order, spelled so that
    dynamo traces it on every torch commfold supports: funcol.all_gather_single where
    it exists (torch >= 2.13); before, all_gather_tensor on a dim other than 0 calls a
    helper dynamo will not trace (a graph break: the gather would run outside the
    graph), so gather dim 0 and move the rank dim next to the last."""
    single = getattr(funcol, "all_gather_single", None)
    if single is not None:
        return single(x, x.dim() - 1, group)
    world = dist.get_world_size(group)
    full = funcol.all_gather_tensor(x.contiguous(), 0, group)
    return full.view(world, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 1000
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 128
    eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    seed: int = 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, by hand: statistics in float32, cast back before the weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(dtype) * weight


def _shard(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return full.chunk(world, dim=dim)[rank].contiguous()


class TPDecoder(nn.Module):
    """Next-token greedy decoder over ids [batch, seq] -> token ids [batch].

    ``group``: the process group the model is sharded over (default: WORLD).
    """

    def __init__(self, cfg: DecoderConfig = DecoderConfig(), group=None):
        super().__init__()
        self.cfg = cfg
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        w, r = self.world, self.rank
        if cfg.heads % w or cfg.ffn % w:
            raise ValueError(f"heads ({cfg.heads}) and ffn ({cfg.ffn}) must divide by the "
                             f"world size {w}")
        self.head_dim = cfg.hidden // cfg.heads
        self.local_heads = cfg.heads // w
        self.shard_vocab = -(-cfg.vocab // w)  # padded vocab / world
        self.vocab_start = r * self.shard_vocab
        self.vocab_end = self.vocab_start + self.shard_vocab

        g = torch.Generator().manual_seed(cfg.seed)
        H, V, Vp = cfg.hidden, cfg.vocab, self.shard_vocab * w

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=g) * scale

        def param(t):
            return nn.Parameter(t.to(cfg.dtype), requires_grad=False)

        def padded(t):  # [V, H] -> [Vp, H] with zero rows past the true vocab
            return torch.cat([t, t.new_zeros(Vp - V, H)])

        self.embed = param(_shard(padded(randn(V, H)), 0, r, w))
        self.lm_head = param(_shard(padded(randn(V, H, scale=H ** -0.5)), 0, r, w))
        self.layers = nn.ModuleList()
        for _ in range(cfg.layers):
            layer = nn.Module()
            layer.qkv = param(torch.cat([_shard(randn(H, H, scale=H ** -0.5), 0, r, w)
                                         for _ in range(3)]))
            layer.o = param(_shard(randn(H, H, scale=H ** -0.5), 1, r, w))
            layer.gate_up = param(torch.cat([_shard(randn(cfg.ffn, H, scale=H ** -0.5), 0, r, w)
                                             for _ in range(2)]))
            layer.down = param(_shard(randn(H, cfg.ffn, scale=cfg.ffn ** -0.5), 1, r, w))
            layer.attn_norm = param(1.0 + 0.1 * randn(H))
            layer.mlp_norm = param(1.0 + 0.1 * randn(H))
            self.layers.append(layer)
        self.input_norm = param(1.0 + 0.1 * randn(H))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        x = F.embedding(local, self.embed)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return funcol.all_reduce(x, "sum", self.group)

    def attention(self, layer, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (x @ layer.qkv.t()).split(self.local_heads * self.head_dim, dim=-1)
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.transpose(1, 2).reshape(b, s, -1) @ layer.o.t()

    def mlp(self, layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ layer.gate_up.t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ layer.down.t()

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [batch, seq, hidden]."""
        eps = self.cfg.eps
        residual = self.embed_tokens(ids)
        h = rms_norm(residual, self.input_norm, eps)
        for layer in self.layers:
            residual = funcol.all_reduce(self.attention(layer, h), "sum", self.group) + residual
            h = rms_norm(residual, layer.attn_norm, eps)
            residual = funcol.all_reduce(self.mlp(layer, h), "sum", self.group) + residual
            h = rms_norm(residual, layer.mlp_norm, eps)  # the last layer's is the final norm
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [..., vocab]: local shard matmul, gather, drop padding."""
        shard = h @ self.lm_head.t()
        full = gather_last_dim(shard, self.group)
        return full[..., : self.cfg.vocab]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.hidden_states(ids)[:, -1]
        return self.logits(h).argmax(dim=-1)


def greedy_decode(step, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Run `steps` greedy steps of `step` (ids [B, S] -> next ids [B]) over a sliding
    window of fixed length S (fixed shapes: one compile). Returns [B, steps] tokens."""
    out = []
    for _ in range(steps):
        nxt = step(ids)
        out.append(nxt)
        ids = torch.cat([ids[:, 1:], nxt[:, None]], dim=1)
    return torch.stack(out, dim=1)


def sample_ids(cfg: DecoderConfig, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """The same random prompt ids on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (batch, seq), generator=g)


def greedy_vs_inductor(decode, model, ids) -> dict:
    """decode(step_fn, ids) with model compiled by stock Inductor and by commfold on
    this rank; raises if the greedy tokens differ; returns this rank's tokens, report
    summary and rewrites per pass (what the examples and `commfold diff` show)."""
    import commfold

    with torch.no_grad():
        expected = decode(torch.compile(model, backend="inductor"), ids)
        commfold.clear_reports()
        tokens = decode(torch.compile(model, backend="commfold"), ids)
    if not torch.equal(tokens, expected):
        raise AssertionError(f"rank {dist.get_rank()}: commfold changed the greedy tokens:\n"
                             f"{tokens}\nvs stock Inductor\n{expected}")
    report = commfold.last_report()
    return {"rank": dist.get_rank(), "tokens": tokens.tolist(), "summary": report.summary(),
            "rewrites": {p: report.count(p) for p in commfold.ALL_PASSES}}


def show_comparison(results: list) -> None:
    """Print greedy_vs_inductor's results of every rank; exit 1 if ranks disagree."""
    print(results[0]["summary"])
    print("rewrites per pass, per rank:", [r["rewrites"] for r in results])
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    print(f"greedy tokens identical to stock Inductor on {len(results)} rank(s)"
          f"{', and across ranks' if same else ''}: {results[0]['tokens']}")
    if not same:
        raise SystemExit("ranks produced different tokens")
