"""Greedy token selection over vLLM's vocab-parallel LM head without gathering logits.

vLLM computes logits and the greedy argmax eagerly, outside its compiled model graph,
so commfold's graph passes never see them. Here ``compute_logits -> argmax`` is
compiled with the commfold backend: its local_argmax pass turns "all-gather the
logits, slice off the vocab padding, argmax" into a per-rank argmax plus one gather
of (value, index) pairs, on the same communicator vLLM used (shared memory, gloo or
vLLM's custom ops). Bit for bit the same token as the full gather, ties included.

Draft proposers with ``use_local_argmax_reduction`` call ``model.get_top_tokens`` and
refuse a drafter that lacks it; ``install_get_top_tokens`` supplies this one (the
vLLM plugin does so when COMMFOLD_VLLM=1). Nothing here imports vLLM.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .backend import backend
from .config import Config

LOCAL_ARGMAX = Config(passes=("local_argmax",))


def top_tokens_fn(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                  config: Config | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden states [T, H] -> greedy token ids [T] (int64): ``argmax`` of
    ``compute_logits(hidden)`` over the vocab, compiled with commfold (dynamic T).
    A compute_logits commfold cannot rewrite still runs correctly, with the gather
    (the report says why)."""

    def greedy(hidden: torch.Tensor) -> torch.Tensor:
        return compute_logits(hidden).argmax(dim=-1)

    compiled = torch.compile(greedy, backend=backend(config=config or LOCAL_ARGMAX), dynamic=True)

    def top_tokens(hidden: torch.Tensor) -> torch.Tensor:
        # Float attributes (logit scale, soft cap) as constants, not graph inputs: the
        # pass must see their sign to know the ops keep the argmax.
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(hidden)

    return top_tokens


def lm_head_top_tokens(logits_processor, lm_head, config: Config | None = None):
    """The greedy pick of vLLM's ``LogitsProcessor`` over a ``ParallelLMHead``: the
    drop-in for ``logits_processor.get_top_tokens(lm_head, hidden)``."""
    return top_tokens_fn(lambda h: logits_processor(lm_head, h), config)


def install_get_top_tokens(model, config: Config | None = None) -> bool:
    """Give `model` a ``get_top_tokens(hidden)`` built from its ``compute_logits`` if it
    has none; True when one was installed. The model's class is not modified."""
    if callable(getattr(model, "get_top_tokens", None)):
        return False
    if not callable(getattr(model, "compute_logits", None)):
        raise TypeError(f"commfold: {type(model).__name__} has no compute_logits() "
                        "to build get_top_tokens from")
    model.get_top_tokens = top_tokens_fn(model.compute_logits, config)
    return True
