"""The target pick under LoRA (commfold.vllm.target.lora_head): kept where no adapter
can touch the LM head - the LoRA config's target modules, through vLLM's own filter,
leave it out - and refused with the reason where one can (target modules unset on a
model whose class lists lm_head, lm_head named, the embedding of a tied head named, a
LoRA layer vLLM put around the head or its logits processor). The engine side:
tests/test_vllm_lora_engine.py."""
from __future__ import annotations

import pytest
import torch

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed()

from commfold.vllm.target.lora_head import head_touched  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(16, 8)


class TinyForCausalLM(torch.nn.Module):
    """What the filter reads of a vLLM model class: embedding_modules (Llama's),
    packed_modules_mapping; the head as an attribute (tied: the embedding itself)."""
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, tied=False):
        super().__init__()
        self.model = Inner()
        self.lm_head = self.model.embed_tokens if tied else torch.nn.Linear(8, 16)


def _lora(targets):
    from vllm.config import LoRAConfig

    return LoRAConfig(max_lora_rank=8, target_modules=targets)


@pytest.mark.parametrize("lora", [None, False])
def test_no_lora(lora):
    model = TinyForCausalLM()
    assert head_touched(lora, model, model.lm_head) is None


def test_projections_only_keep_the_pick():
    model = TinyForCausalLM()
    assert head_touched(_lora(PROJECTIONS), model, model.lm_head) is None
    # packed names, as vLLM's runtime modules are called, also leave the head alone
    assert head_touched(_lora(["qkv_proj", "gate_up_proj"]), model, model.lm_head) is None
    # an input-embedding adapter changes hidden states, not an untied head
    assert head_touched(_lora(["embed_tokens"]), model, model.lm_head) is None


def test_target_modules_unset_may_adapt_the_head():
    model = TinyForCausalLM()
    why = head_touched(_lora(None), model, model.lm_head)
    assert why == ("LoRA may adapt the LM head (lm_head; target modules unset: every module "
                   "the model supports): --lora-target-modules without it keeps the pick local")


def test_lm_head_named():
    model = TinyForCausalLM()
    why = head_touched(_lora(["q_proj", "lm_head"]), model, model.lm_head)
    assert why.startswith("LoRA may adapt the LM head (lm_head; target modules "
                          "q_proj,lm_head)"), why


def test_tied_head_through_its_embedding():
    model = TinyForCausalLM(tied=True)
    why = head_touched(_lora(["embed_tokens"]), model, model.lm_head)
    assert why.startswith("LoRA may adapt the LM head (model.embed_tokens;"), why
    assert head_touched(_lora(PROJECTIONS), model, model.lm_head) is None


def test_a_model_without_lm_head_in_its_lora_modules():
    class NoHeadLoRA(TinyForCausalLM):
        embedding_modules = {}

    model = NoHeadLoRA()
    assert head_touched(_lora(None), model, model.lm_head) is None


def test_head_wrapped_by_vllm():
    """A model as vLLM left it after wrapping lm_head: its logits processor inside
    LogitsProcessorWithLoRA (built without a TP group: only its type is read)."""
    from vllm.lora.layers import LogitsProcessorWithLoRA

    model = TinyForCausalLM()
    wrapper = LogitsProcessorWithLoRA.__new__(LogitsProcessorWithLoRA)
    torch.nn.Module.__init__(wrapper)
    model.logits_processor = wrapper
    why = head_touched(_lora(PROJECTIONS), model, model.lm_head)
    assert why == "LoRA wrapped the LM head (logits_processor): adapters add to the " \
        "gathered logits"


def test_lora_config_unknown():
    model = TinyForCausalLM()
    assert head_touched(True, model, model.lm_head).startswith("LoRA (its config not known")
