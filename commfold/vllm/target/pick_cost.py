"""The cost rule for vLLM's token picks, asked once per engine step: is commfold's
local pick (from this rank's logits shard) measured slower than vLLM's all-gather of
the logits for this step's rows, on this engine's communicator? (commfold.cost, the
LOCAL_PICK and LOCAL_LOGPROBS rules.) The answer reads only the step's row count, the
logits' dtype and vocab and the TP group's communicator: the same on every rank.
COMMFOLD_PICK_COST_RULE=0 takes every step the decision allows, measured slower or
not (tests of the pick's numerics on small vocabularies set it)."""
from __future__ import annotations

import functools
import os

import torch

from commfold import cost


ENV = "COMMFOLD_PICK_COST_RULE"


def enabled(environ=os.environ) -> bool:
    return environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=16)
def _comm(spec: str, device: str) -> str:
    from commfold.distributed.collectives import communicator

    return cost.comm_name(communicator(spec), device)


def slower(mode: str, rows: int, dtype: torch.dtype, device: str, comm_spec: str,
           vocab: int, world: int) -> str | None:
    """Why this step's local pick in `mode` ("greedy", "verify", "draft", "logprobs",
    "sample", "sample_logprobs") would be slower than vLLM's gather, or None (take
    it)."""
    if not enabled():
        return None
    rule = (cost.SAMPLED_PICK if mode in ("sample", "sample_logprobs", "verify_sampled")
            else cost.LOCAL_LOGPROBS if mode == "logprobs" else cost.LOCAL_PICK)
    return cost.why_slower(cost.pick_site(rule, device, _comm(comm_spec, device), dtype,
                                          rows, vocab, world))


def slower_block(reqs: int, positions: int, dtype: torch.dtype, device: str, comm_spec: str,
                 vocab: int, world: int) -> str | None:
    """Why a DSpark draft block's local pick (one exchange per position) would be
    slower than vLLM's one gather of its base logits, or None (take it)."""
    if not enabled():
        return None
    return cost.why_slower(cost.dspark_site(device, _comm(comm_spec, device), dtype, reqs,
                                            positions, vocab, world))


def gate(mode: str | None, why: str, rows: int, like: torch.Tensor, head
         ) -> tuple[str | None, str]:
    """The target pick's decision (mode, why) after the cost table: (None, the rule's
    reason) where the local pick of `rows` rows of `like`'s dtype over `head` (a
    LogitsHead: communicator, vocab, world) is slower - or, verifying sampled
    requests, sends no fewer bytes (commfold.shard.layout.no_saving) -, else unchanged."""
    if mode is None:
        return mode, why
    reason = slower(mode, rows, like.dtype, like.device.type, head.comm, head.vocab,
                    head.world)
    if reason is None and mode == "verify_sampled" and enabled():
        from commfold.shard.layout import no_saving

        reason = no_saving(head.shard, head.vocab, head.world,
                                        like.element_size())
    return (None, reason) if reason else (mode, why)


def slower_for_model(mode: str, hidden: torch.Tensor, model) -> str | None:
    """slower() for a pick over `model`'s logits (a drafter's): its vocab-parallel head
    and vLLM's TP group, found once per model; None where no head is found (the pick
    runs as before the rule)."""
    if not enabled():
        return None
    layout = model.__dict__.get("_commfold_pick_layout", False)
    if layout is False:
        layout = model.__dict__["_commfold_pick_layout"] = _layout(model)
    if layout is None:
        return None
    comm, vocab, world = layout
    return slower(mode, hidden.shape[0], hidden.dtype, hidden.device.type, comm, vocab, world)


def _layout(model) -> tuple[str, int, int] | None:
    from vllm.distributed import get_tp_group

    from commfold.vllm.target.logits_head import comm_spec, head_layer

    layer, _ = head_layer(model)
    tp = get_tp_group()
    vocab = getattr(layer, "org_vocab_size", None)
    if layer is None or vocab is None or tp.world_size < 2:
        return None
    return comm_spec(tp), int(vocab), tp.world_size
