"""Tiny Hugging Face model directories written offline (config + a tokenizer trained
on a few strings; weights optional) for vLLM runs: nothing is downloaded. Without
weights, load with ``load_format="dummy"`` (vLLM's uniform +-1e-3: nearly uniform
logits of ~1e-5); with them, random weights at a real model's scale (transformers'
initialization), for tests whose outcome depends on logits spread like a real
model's. Used by the vLLM examples and the vLLM tests."""
from __future__ import annotations

from pathlib import Path

_TEXTS = ["the quick brown fox jumps over the lazy dog",
          "tensor parallel inference removes communication",
          "hello world, commfold folds collectives into kernels",
          "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9"]

SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)

# arch -> (transformers config class, the config's `architectures` entry (vLLM's model
# class), the few config fields the family needs besides SIZES). SIZES' fields go to
# every config (a config keeps a field its model does not read).
ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # sandwich norms (pre + post around attention and MLP), Gemma's 1 + w, sqrt(hidden)
    # embedding normalizer, soft caps; both layer types (sliding, global) within 2 layers
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        query_pre_attn_scalar=32, sliding_window=64, hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        tie_word_embeddings=True)),
    # scaled residual branches and embedding (Granite 3's multipliers)
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 32,
        logits_scaling=8.0)),
    # a sparse MoE block in every layer: 4 experts, top 2
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    # post-norm: the norms read attention's and the MLP's outputs, before the residual add
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # LayerNorm (pre-norm), learned positions, biases
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=256, word_embed_proj_dim=128,
                                                 do_layer_norm_before=True)),
}


# a JSON text: with it in the tokenizer's training, a JSON-schema request has tokens
JSON_TEXTS = ('{"n": 12, "name": "the fox"}',)


def write_model(path: str | Path, arch: str = "qwen3", vocab_size: int = 1000,
                weights: bool = False, texts: tuple[str, ...] = (), **overrides) -> Path:
    """A loadable model directory of `arch` (a key of ARCHS): config + a tokenizer
    trained on a few strings; with ``weights``, seeded random weights (model.safetensors,
    load_format "auto"), else none (load_format "dummy": ``load_format(path)``).
    vocab_size 1000 is not a multiple of vLLM's padding (64 x TP), so the LM head carries
    padding rows. texts: more strings for the tokenizer (JSON_TEXTS: its characters).
    `overrides` replace SIZES' and ARCHS' fields."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "</s>"]
    tok.train_from_iterator([*_TEXTS, *texts] * 4, trainers.BpeTrainer(
        vocab_size=min(vocab_size, 300), special_tokens=specials, show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    cls_name, architecture, fields = ARCHS[arch]
    cfg = getattr(transformers, cls_name)(vocab_size=vocab_size, bos_token_id=1,
                                          eos_token_id=2, architectures=[architecture],
                                          **{**SIZES, **fields, **overrides})
    cfg.save_pretrained(path)
    if weights:  # transformers' init: N(0, 0.02) matrices, norms of ones; seeded
        import torch
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def load_format(path: str | Path) -> str:
    """vLLM's load_format for a write_model directory."""
    return "auto" if (Path(path) / "model.safetensors").exists() else "dummy"
