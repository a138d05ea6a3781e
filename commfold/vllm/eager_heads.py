"""Small vocab-parallel layers a drafter runs eagerly, once per draft position, outside
any compiled graph: DSpark's Markov head (Model Runner V2's DSpark speculator calls
``markov_embed(prev)`` then ``markov_bias(embed)`` for every position).

vLLM ships that head replicated by hand (an ``nn.Embedding`` and a ``ParallelLMHead``
with ``disable_tp``): sharded, it would add an all-reduce and a full-vocab gather to
each position. A head built sharded - as before that edit, or by a variant that
shards it - gets the same change from commfold: each of the two calls is compiled
with the ``replicate_vocab_parallel`` pass under its size limits (the config's),
so a layer whose full weight fits is replicated on every rank and its collective
disappears; what the pass cannot take stays as it was, with a near-miss that says why
(on vLLM CPU the head's matmul runs on a oneDNN-packed weight). A head already
replicated is left as is. Each case logs one line.
"""
from __future__ import annotations

import logging
import types

import torch

from commfold.backend import backend
from commfold.config import Config

log = logging.getLogger("commfold")

REPLICATE = "replicate_vocab_parallel"


def sharded_layers(module: torch.nn.Module) -> list[str]:
    """Names of the vocab-parallel layers of `module` that are split across ranks."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return [name for name, m in module.named_modules()
            if isinstance(m, VocabParallelEmbedding) and getattr(m, "tp_size", 1) > 1]


_compiled = 0


def replicated_call(fn, config: Config):
    """fn (an eager call through small vocab-parallel layers) compiled with commfold's
    replicate_vocab_parallel pass; a code object of its own (Dynamo's recompile limit
    is per code object)."""
    global _compiled
    _compiled += 1

    def call(x):
        return fn(x)

    call = types.FunctionType(call.__code__.replace(co_name=f"eager_head_{_compiled}"),
                              call.__globals__, call.__name__, None, call.__closure__)
    chosen = Config(passes=(REPLICATE,), replicate_max_bytes=config.replicate_max_bytes,
                    replicate_head_max_bytes=config.replicate_head_max_bytes)
    return torch.compile(call, backend=backend(config=chosen), dynamic=True,
                         options={"guard_filter_fn":
                                  torch.compiler.skip_guard_on_all_nn_modules_unsafe})


def hook_markov_head(model, config: Config) -> bool:
    """Replicate a sharded DSpark Markov head of `model` (a Qwen3DSparkForCausalLM);
    True when its calls were replaced. Rank-consistent: layer shapes and the config."""
    head = getattr(getattr(model, "model", None), "markov_head", None)
    if head is None or REPLICATE not in config.passes:
        return False
    sharded = sharded_layers(head)
    if not sharded:
        log.info("commfold: %s's Markov head is replicated already (as vLLM ships it): "
                 "left as is", type(model).__name__)
        return False
    model.markov_embed = replicated_call(model.markov_embed, config)
    model.markov_bias = replicated_call(model.markov_bias, config)
    log.info("commfold: %s's Markov head is sharded (%s): its per-position calls are "
             "compiled with %s (the report says what was replicated)",
             type(model).__name__, ", ".join(sharded), REPLICATE)
    return True
