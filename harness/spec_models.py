"""Tiny speculative-decoding model sets with real, seeded weights, written offline
(config + safetensors + a tokenizer), for vLLM engine runs of every drafter kind.

vLLM's dummy weights (every tensor uniform in +-1e-3 from one seed) make a target
whose next token is a fixed function of the current one and a same-family drafter
that always agrees (acceptance 100%), and an EAGLE drafter that never does (0%):
the verify step then only accepts or only rejects. These weights have a structure
instead: the embeddings are random unit vectors and the LM head row of perm[t] is
E[t], so the target's next token is mostly ``perm[t]``; its layers' random weights
(std ``sigma``) push it off the permutation now and then. Drafters that compute the
permutation are right often and wrong sometimes:

- ``draft_model``: the target's first layer, embedding, final norm and head (an
  early-exit drafter);
- ``eagle3``: ``LlamaForCausalLMEagle3`` over a draft vocab smaller than the
  target's (``d2t`` remap, strictly increasing); ``fc`` passes the target's layer-0
  input (the embedding of token i) through and the head scores perm(perm(t)), so its
  first draft (token i+2) is right when the target followed the permutation twice
  and the draft vocab holds the token; later drafts repeat it (mostly rejected);
- ``eagle``: ``EagleLlamaForCausalLM``; ``fc`` passes the new token's embedding
  through and the target's own (shared) head scores perm(t): every draft position
  can be accepted;
- ``mtp``: a MiMo target (Qwen2 layers) with one MTP layer built the same way (one
  draft token per step), the shape of vLLM's MTP change: the drafter's trailing
  all-reduce feeds its final RMSNorm.

The permutation maps the ids below ``hot`` onto themselves and the head rows of the
other ids are halved, so the target, started from prompts drawn there, stays inside
a set that the EAGLE-3 draft vocab covers (the head still spans the whole vocab).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .tiny_models import SIZES, write_model

# Layer weight std at hidden 128: the target leaves the permutation on ~8% of steps
# (2 layers, V=151936; measured with transformers' Llama in f32). Other widths scale
# it by (128 / hidden) ** 0.75 (see default_sigma).
SIGMA = 0.04
DRAFT_SCALE = 1 / 8  # the EAGLE drafters' own layer: a small perturbation
EAGLE3_AUX_LAYERS = [0, 1]  # the target's embedding output and its layer-0 output


class SpecModels:
    """Weights of one model set, built from a seed (deterministic on every machine)."""

    def __init__(self, vocab_size: int = 151936, hot: int = 32768, sigma: float | None = None,
                 seed: int = 0, **sizes):
        self.sizes = {**SIZES, **sizes}
        self.vocab, self.hot, self.seed = vocab_size, min(hot, vocab_size), seed
        h = self.sizes["hidden_size"]
        g = torch.Generator().manual_seed(seed)  # the permutation: the same at every width
        self.perm = torch.cat([torch.randperm(self.hot, generator=g),
                               self.hot + torch.randperm(vocab_size - self.hot, generator=g)])
        self.inv = torch.argsort(self.perm)
        g = torch.Generator().manual_seed(seed * 7919 + h)
        emb = torch.randn(vocab_size, h, generator=g)
        self.embed = emb / emb.norm(dim=1, keepdim=True)
        self.head = self.embed[self.inv]  # row perm[t] is E[t]: argmax of head @ E[t]
        self.head[self.hot:] *= 0.5  # ids past the hot set rarely win: the target stays there
        self.sigma = default_sigma(h) if sigma is None else sigma
        self.layers = [self._layer(g, self.sigma, 1)
                       for _ in range(self.sizes["num_hidden_layers"])]

    def _layer(self, g, sigma: float, qkv_in: int) -> dict:
        s = self.sizes
        h, inter, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
        q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
        shapes = {"self_attn.q_proj": (q, qkv_in * h), "self_attn.k_proj": (kv, qkv_in * h),
                  "self_attn.v_proj": (kv, qkv_in * h), "self_attn.o_proj": (h, q),
                  "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        w = {f"{k}.weight": torch.randn(shape, generator=g) * sigma for k, shape in shapes.items()}
        w["post_attention_layernorm.weight"] = torch.ones(h)
        return w

    def prompts(self, n: int, length: int = 6) -> list[list[int]]:
        return hot_prompts(n, length, self.hot, self.seed)

    # --- model directories ---------------------------------------------------

    def _dir(self, path, layers: int, **config) -> Path:
        path = write_model(path, "llama", vocab_size=self.vocab,
                           **{**self.sizes, "num_hidden_layers": layers})
        if config:
            cfg_file = path / "config.json"
            cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **config},
                                           indent=1))
        return path

    def _weights(self, layers: int, bias: bool = False) -> dict:
        h = self.sizes["hidden_size"]
        w = {"model.embed_tokens.weight": self.embed, "lm_head.weight": self.head,
             "model.norm.weight": torch.ones(h)}
        for i, layer in enumerate(self.layers[:layers]):
            w[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(h)
            w.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
            if bias:
                w.update(_qkv_bias(f"model.layers.{i}.", layer))
        return w

    def _llama(self, path, layers: int) -> Path:
        path = self._dir(path, layers)
        _save(self._weights(layers), path)
        return path

    def write_target(self, path) -> Path:
        return self._llama(path, self.sizes["num_hidden_layers"])

    def write_draft_model(self, path, layers: int = 1, **sizes) -> Path:
        """An early-exit drafter: the target's first `layers` layers, norm and head; or,
        with other `sizes` (a narrower drafter), a model of its own with the same
        permutation structure."""
        if all(self.sizes.get(k) == v for k, v in sizes.items()):
            return self._llama(path, layers)
        other = SpecModels(self.vocab, self.hot, seed=self.seed,
                           **{**self.sizes, **sizes, "num_hidden_layers": layers})
        return other.write_target(path)

    def draft_vocab(self, size: int = 32000) -> torch.Tensor:
        """The EAGLE-3 draft vocab: target ids, strictly increasing, skipping those
        = 3 (mod 17) (so d2t is not a plain offset and some targets cannot be drafted)."""
        ids = torch.arange(self.vocab)
        return ids[ids % 17 != 3][:size]

    def write_eagle3(self, path, draft_vocab_size: int = 32000) -> Path:
        h = self.sizes["hidden_size"]
        targets = self.draft_vocab(draft_vocab_size)
        n_aux = len(EAGLE3_AUX_LAYERS)
        path = self._dir(path, 1, architectures=["LlamaForCausalLMEagle3"],
                         draft_vocab_size=len(targets),
                         eagle_config={"eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_LAYERS})
        g = torch.Generator().manual_seed(self.seed + 2)
        fc = torch.zeros(h, n_aux * h)
        fc[:, :h] = torch.eye(h)  # the first aux state: the target's embedding of token i
        w = {"fc.weight": fc, "norm.weight": torch.ones(h),
             "lm_head.weight": self.embed[self.inv[self.inv[targets]]],  # perm(perm(t))
             "d2t": targets - torch.arange(len(targets))}
        layer = self._layer(g, self.sigma * DRAFT_SCALE, 2)
        layer.update({"input_layernorm.weight": torch.ones(h), "hidden_norm.weight": torch.ones(h)})
        w.update({f"midlayer.{k}": v for k, v in layer.items()})
        _save(w, path)
        return path

    def write_mimo(self, path) -> Path:
        """A MiMo model (Qwen2 layers, q/k/v biases zero) with one MTP layer: the
        target and, with method "mtp", its drafter. The MTP layer's ``input_proj``
        passes the new token's (normed) embedding through, its block adds a small
        perturbation, and the shared head scores perm(t): the draft is right when the
        target follows the permutation. vLLM's MiMo MTP has no get_top_tokens."""
        h, layers = self.sizes["hidden_size"], self.sizes["num_hidden_layers"]
        path = self._dir(path, layers, architectures=["MiMoForCausalLM"], model_type="qwen2",
                         num_nextn_predict_layers=1, attention_bias=True)
        w = self._weights(layers, bias=True)
        g = torch.Generator().manual_seed(self.seed + 4)
        proj = torch.zeros(h, 2 * h)
        proj[:, h:] = torch.eye(h)  # [previous hidden, token embedding] -> the embedding
        block = self._layer(g, self.sigma * DRAFT_SCALE, 1)
        mtp = {"input_proj.weight": proj, "input_layernorm.weight": torch.ones(h),
               **{k: torch.ones(h) for k in ("token_layernorm.weight", "hidden_layernorm.weight",
                                             "final_layernorm.weight")},
               **block, **_qkv_bias("", block)}
        w.update({f"model.mtp_layers.0.{k}": v for k, v in mtp.items()})
        _save(w, path)
        return path

    def write_eagle(self, path) -> Path:
        h = self.sizes["hidden_size"]
        path = self._dir(path, 1, architectures=["EagleLlamaForCausalLM"])
        g = torch.Generator().manual_seed(self.seed + 3)
        fc = torch.zeros(h, 2 * h)
        fc[:, :h] = torch.eye(h)  # the new token's embedding; the head is the target's
        w = {"fc.weight": fc}
        layer = self._layer(g, self.sigma * DRAFT_SCALE, 1)
        w.update({f"layers.0.{k}": v for k, v in layer.items()})
        _save(w, path)
        return path


def hot_prompts(n: int, length: int = 6, hot: int = 32768, seed: int = 0) -> list[list[int]]:
    """n token-id prompts from the hot set (seeded)."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(3, hot, (n, length), generator=g).tolist()


def default_sigma(hidden: int) -> float:
    """The layer weight std that keeps the target on the permutation ~90% of steps."""
    return SIGMA * (SIZES["hidden_size"] / hidden) ** 0.75


def _qkv_bias(prefix: str, layer: dict) -> dict:
    return {f"{prefix}self_attn.{p}.bias": torch.zeros(layer[f"self_attn.{p}.weight"].shape[0])
            for p in ("q_proj", "k_proj", "v_proj")}


def _save(weights: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: (v.contiguous() if v.dtype == torch.int64 else v.to(torch.bfloat16).contiguous())
               for k, v in weights.items()}, str(path / "model.safetensors"))
