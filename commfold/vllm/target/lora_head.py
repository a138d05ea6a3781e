"""Whether a LoRA adapter can change the logits a target pick reads from its shard.

In vLLM 0.32 to 0.34, LoRA wraps the modules its config targets
(``LoRAConfig.target_modules``, ``--lora-target-modules``; unset: every module the
model supports - its linear layers and the names its class lists in
``embedding_modules``, ``lm_head`` and ``embed_tokens`` on Llama and Qwen). Wrapping
``lm_head`` replaces the model's LogitsProcessor by ``LogitsProcessorWithLoRA``, which
adds an adapter's delta to the logits after the TP gather: no shard holds them (vLLM
itself refuses to skip that gather). An adapter of the attention and MLP projections
changes the hidden states the head reads, never the head, so the shard's logits are
the model's. No adapter adds vocabulary: ``lora_extra_vocab_size`` is gone and an
embedding adapter must match the model's vocab. An input-embedding adapter reaches the
head only where the head is that embedding (tied weights).

So the answer comes from the LoRA config and the model's class, through vLLM's own
target filter - the same on every rank - and, as a check, from the model as vLLM
wrapped it (a LoRA layer on the head or around the logits processor)."""
from __future__ import annotations


def head_touched(lora, model, head) -> str | None:
    """Why an adapter could change `head`'s logits under LoRA config `lora` (None: no
    LoRA, or no adapter can). `lora`: the engine's LoRAConfig, None, or True (LoRA on,
    its config not at hand: assumed to touch the head)."""
    if lora is None or lora is False:
        return None
    if lora is True:
        return "LoRA (its config not known here: an adapter may touch the LM head)"
    from vllm.lora.layers import BaseLayerWithLoRA, LogitsProcessorWithLoRA
    from vllm.lora.utils import get_supported_lora_modules, is_in_target_modules

    wrapped = [name for name, m in model.named_modules()
               if isinstance(m, LogitsProcessorWithLoRA)
               or (isinstance(m, BaseLayerWithLoRA) and getattr(m, "base_layer", None) is head)]
    if wrapped:
        return f"LoRA wrapped the LM head ({', '.join(wrapped)}): adapters add to the " \
            "gathered logits"
    names = sorted({n for n, m in model.named_modules(remove_duplicate=False) if m is head}
                   | {"lm_head"})
    supported = set(get_supported_lora_modules(model))
    packed = getattr(model, "packed_modules_mapping", None) or {}
    reach = [n for n in names if n.rsplit(".", 1)[-1] in supported
             and is_in_target_modules(n, lora.target_modules, packed)]
    if not reach:
        return None
    targets = ",".join(lora.target_modules) if lora.target_modules else \
        "unset: every module the model supports"
    return f"LoRA may adapt the LM head ({', '.join(reach)}; target modules {targets}): " \
        "--lora-target-modules without it keeps the pick local"
