"""Small vocab-parallel layers a drafter runs eagerly, once per draft position, outside
any compiled graph: DSpark's Markov head (Model Runner V2's DSpark speculator calls
``markov_embed(prev)`` then ``markov_bias(embed)`` for every position).

vLLM ships that head replicated by hand (an ``nn.Embedding`` and a ``ParallelLMHead``
with ``disable_tp``): sharded, it would add an all-reduce and a full-vocab gather to
each position. A head built sharded - as before that edit, or by a variant that
shards it - gets the same edit from commfold, at load: each sharded layer whose full
weight fits the replicate pass's size limits (the config's; heads also the device's
measured head limit) is rebuilt as vLLM builds a replicated one (its own class with
``disable_tp=True``, the full weight gathered once from the shards, vLLM's own
post-load processing, e.g. vLLM CPU's oneDNN packing), so its per-position collective
is gone and it computes exactly what vLLM's hand-replicated head computes. Layers it
cannot rebuild exactly (quantized, LoRA-added vocabulary, no reduction, a subclass,
over the limit) stay sharded, named in the one log line with the reason. A head
already replicated is left as is.
"""
from __future__ import annotations

import gc
import logging

import torch

from commfold.config import Config
from commfold.cost import head_limit

log = logging.getLogger("commfold")

REPLICATE = "replicate_vocab_parallel"


def sharded_layers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, layer) of the vocab-parallel layers of `module` split across ranks."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, VocabParallelEmbedding) and getattr(m, "tp_size", 1) > 1]


def full_bytes(layer) -> int:
    """Bytes of the layer's full (unsharded, unpadded) weight."""
    return layer.org_vocab_size * layer.embedding_dim * layer.weight.element_size()


def why_kept(layer, config: Config) -> str | None:
    """Why `layer` stays sharded, or None when it is rebuilt replicated. From its class,
    shapes and the config only: the same on every rank."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead, UnquantizedEmbeddingMethod, VocabParallelEmbedding)

    if type(layer) not in (VocabParallelEmbedding, ParallelLMHead):
        return f"{type(layer).__name__}, a subclass commfold does not rebuild"
    if not isinstance(layer.quant_method, UnquantizedEmbeddingMethod):
        return f"quantized ({type(layer.quant_method).__name__})"
    if layer.num_added_embeddings:
        return "LoRA-added vocabulary"
    if not isinstance(layer, ParallelLMHead) and not layer.reduce_results:
        return "reduce_results=False (its caller reduces)"
    size = full_bytes(layer)
    limit, what = (head_limit(config, layer.weight.device.type)
                    if isinstance(layer, ParallelLMHead)
                    else (config.replicate_max_bytes, "replicate_max_bytes"))
    if size > limit:
        return f"full weight {size} B over {what} ({limit} B)"
    return None


def _full(layer, shard: torch.Tensor, group) -> torch.Tensor:
    """The full [org_vocab_size, ...] tensor from every rank's padded shard of it, in
    vocab order (vLLM's own shard -> token mapping; no added vocabulary here)."""
    gathered = group.all_gather(shard.contiguous(), dim=0)
    return gathered[layer.get_sharded_to_full_mapping()[:layer.org_vocab_size]]


def replicated(layer):
    """`layer` rebuilt with ``disable_tp=True`` and its full weight, as vLLM builds a
    replicated one. A collective over the layer's TP group: every rank calls it."""
    from vllm.distributed import get_tp_group
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    group = getattr(layer, "parallel_group", None) or get_tp_group()
    weight = _full(layer, layer.weight.data, group)
    bias = getattr(layer, "bias", None)
    bias = _full(layer, bias.data, group) if isinstance(bias, torch.Tensor) else None
    common = dict(params_dtype=layer.params_dtype, org_num_embeddings=layer.org_vocab_size,
                  padding_size=layer.padding_size, prefix=layer.prefix)
    if isinstance(layer, ParallelLMHead):
        common["bias"] = bias is not None
    with torch.device(layer.weight.device):
        new = type(layer)(layer.num_embeddings, layer.embedding_dim, disable_tp=True,
                          **common)
    new.weight_loader(new.weight, weight)
    if bias is not None:
        new.weight_loader(new.bias, bias)
    for key, value in vars(layer).items():  # flags callers set (DSpark's gather flags)
        if key not in vars(new) and isinstance(value, (bool, int, float, str)):
            setattr(new, key, value)
    new.quant_method.process_weights_after_loading(new)
    return new


def replicate_sharded(module: torch.nn.Module, config: Config) -> tuple[list[str], list[str]]:
    """Replace each sharded vocab-parallel layer of `module` that qualifies by its
    replicated rebuild; (replicated "name (bytes)", kept "name: why")."""
    done, kept = [], []
    for name, layer in sharded_layers(module):
        why = why_kept(layer, config)
        if why:
            kept.append(f"{name}: {why}")
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name), attr, replicated(layer))
        done.append(f"{name} ({full_bytes(layer)} B)")
    # the replaced layers are freed now, not by a later collection that could run inside
    # a torch.compile: vLLM CPU's oneDNN handle calls .item() as it is freed, which
    # fails under FakeTensorMode (vLLM's layers sit in reference cycles)
    layer = None
    if done:
        gc.collect()
    return done, kept


def hook_markov_head(model, config: Config) -> bool:
    """Replicate a sharded DSpark Markov head of `model` (a Qwen3DSparkForCausalLM);
    True when a layer of it was replicated. One log line says what happened."""
    head = getattr(getattr(model, "model", None), "markov_head", None)
    name = type(model).__name__
    if head is None:
        return False
    if REPLICATE not in config.passes:
        log.info("commfold: %s's Markov head left as is (%s is not among the passes)",
                 name, REPLICATE)
        return False
    if not sharded_layers(head):
        log.info("commfold: %s's Markov head is replicated already (as vLLM ships it): "
                 "left as is", name)
        return False
    done, kept = replicate_sharded(head, config)
    log.info("commfold: %s's Markov head is sharded: replicated %s; kept sharded %s",
             name, ", ".join(done) or "none", "; ".join(kept) or "none")
    return bool(done)
