"""The vocab-parallel head a vLLM runner's model computes its logits with, found once
per runner for the token-pick hooks of both model runners: the model's single
LogitsProcessor, the head's vocab layout, vLLM's TP communicator, and the model's own
``compute_logits`` run with the processor's all-gather as the identity (this rank's
[rows, vocab shard], soft cap and logit scale included).

The head is the layer the processor is called with: ``lm_head`` where the model has
one, else the model's only vocab-parallel layer - a tied head, as Gemma's
``compute_logits`` passes ``model.embed_tokens``. Every call checks that the processor
got that layer (the same on every rank); another one turns the pick off, logged."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from commfold.distributed.collectives import CommKind
from commfold.vllm.target.lora_head import head_touched

log = logging.getLogger("commfold")


@dataclass
class LogitsHead:
    model: torch.nn.Module
    processor: torch.nn.Module  # vLLM's LogitsProcessor
    comm: str  # commfold's name for the TP group's communicator
    vocab: int  # the true vocab (org_vocab_size): columns past it are padding
    shard: int  # columns per rank
    layer: torch.nn.Module | None = None  # the vocab-parallel layer of the logits
    world: int = 2  # ranks of the TP group
    logits_local: bool = False  # the shard from the model's compute_logits_local

    @staticmethod
    def find(runner) -> tuple[LogitsHead | None, str]:
        """(head, "") or (None, why not) for a runner's model: everything checked is
        the same on every rank."""
        pp = getattr(getattr(runner, "parallel_config", None), "pipeline_parallel_size", 1)
        return LogitsHead.of(getattr(runner, "model", None),
                             lora=getattr(runner, "lora_config", None),
                             pipeline=pp > 1 or bool(getattr(runner, "broadcast_pp_output",
                                                             False)))

    @staticmethod
    def of(model, *, lora, pipeline: bool,
           logits_local: bool = False) -> tuple[LogitsHead | None, str]:
        """(head, "") or (None, why not) for `model`; lora: the engine's LoRAConfig (or
        None; True: LoRA on, config unknown), refused only where an adapter can touch
        the head (lora_head); logits_local: take the shard from the model's own
        ``compute_logits_local`` where it has one (vLLM's contract for batch-sharded
        sampling: this rank's [rows, vocab shard] of compute_logits)."""
        from vllm.distributed import get_tp_group
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        tp = get_tp_group()
        processors = [m for m in model.modules() if isinstance(m, LogitsProcessor)] \
            if isinstance(model, torch.nn.Module) else []
        if tp.world_size < 2:
            return None, "TP=1 (nothing to gather)"
        head, why = head_layer(model)
        idx = getattr(head, "shard_indices", None)
        if head is None:
            return None, f"{type(model).__name__}: {why}"
        if len(processors) != 1 or idx is None or not callable(
                getattr(model, "compute_logits", None)):
            return None, f"{type(model).__name__}: no single LogitsProcessor + " \
                "vocab-parallel head"
        if processors[0].logits_as_input or not processors[0].use_all_gather:
            return None, "logits processor without all-gather"
        if idx.num_added_elements:
            return None, f"added vocab ({idx.num_added_elements} rows)"
        touched = head_touched(lora, model, head)
        if touched:
            return None, touched
        if pipeline:
            return None, "pipeline parallel"
        shard = head.weight.shape[0]
        vocab = processors[0].org_vocab_size
        if idx.org_vocab_start_index != tp.rank_in_group * shard or shard > vocab:
            return None, f"vocab layout (shard {shard}, vocab {vocab})"
        found = LogitsHead(model, processors[0], comm_spec(tp), vocab, shard, head,
                           tp.world_size)
        found.logits_local = logits_local and callable(
            getattr(model, "compute_logits_local", None))
        return found, ""

    def local_logits(self, hidden, compute=None):
        """`compute` (the model's compute_logits, by default) with the processor's
        gather as the identity: this rank's [rows, shard], or None (logged: the model's
        code gives something else; the same on every rank). With logits_local, the
        model's compute_logits_local stands for its compute_logits."""
        if self.logits_local and compute in (None, self.model.compute_logits):
            out = self.model.compute_logits_local(hidden)
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (hidden.shape[0],
                                                                      self.shard):
                return out
            log.warning("commfold: target pick off: %s.compute_logits_local gave %s, not "
                        "this rank's [rows, %d] shard", type(self.model).__name__,
                        getattr(out, "shape", type(out).__name__), self.shard)
            return None
        compute = compute or self.model.compute_logits
        processor, seen = self.processor, []
        forward = processor.forward
        processor.forward = lambda layer, *a, **kw: (seen.append(layer), forward(layer, *a,
                                                                                 **kw))[1]
        processor._gather_logits = _identity
        try:
            out = compute(hidden)
        finally:
            del processor._gather_logits, processor.forward
        if self.layer is not None and any(layer is not self.layer for layer in seen):
            log.warning("commfold: target pick off: %s.compute_logits called its logits "
                        "processor with another layer than %s", type(self.model).__name__,
                        type(self.layer).__name__)
            return None
        if isinstance(out, torch.Tensor) and tuple(out.shape) == (hidden.shape[0], self.shard):
            return out
        log.warning("commfold: target pick off: %s.compute_logits gave %s without its "
                    "gather, not this rank's [rows, %d] shard", type(self.model).__name__,
                    getattr(out, "shape", type(out).__name__), self.shard)
        return None

    def gather(self, shard):
        """vLLM's gather of the logits (for a step that turns out to need them)."""
        from vllm.distributed import tensor_model_parallel_all_gather

        return tensor_model_parallel_all_gather(shard)[..., :self.vocab]


def head_layer(model):
    """(the vocab-parallel layer the model's logits come from, "") or (None, why)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelEmbedding):
        return head, ""
    layers = {id(m.weight): m for m in model.modules()
              if isinstance(m, VocabParallelEmbedding)} if isinstance(model, torch.nn.Module) \
        else {}
    if len(layers) == 1:  # a tied head: the input embedding
        return next(iter(layers.values())), ""
    return None, (f"no lm_head and {len(layers)} vocab-parallel layers (which one "
                  "compute_logits uses is not known)")


def _identity(logits):
    return logits


def comm_spec(tp) -> str:
    """commfold's name for the communicator vLLM's TP group gathers logits with: its
    CPU shared-memory one, torch.distributed on a CPU group, else vLLM's custom ops."""
    shm = getattr(getattr(tp, "device_communicator", None), "dist_module", None)
    if getattr(shm, "handle", None) is not None:
        return CommKind.VLLM_SHM.spec(shm.handle)
    if tp.device.type == "cpu":
        return CommKind.C10D.spec(tp.device_group.group_name)
    return CommKind.VLLM.spec(tp.unique_name)
