"""One DSpark draft block, vLLM's own ``DSparkSpeculator._sample_sequential`` on a
speculator with only what that method reads (tests and benchmarks of
commfold.vllm.spec_decode.dspark_pick): a drafter with vLLM's real sharded ParallelLMHead +
LogitsProcessor and its shipped (replicated) DSparkMarkovHead, Qwen3DSparkForCausalLM's
own methods, in a vLLM TP group of rank-pool processes. ``run_block`` returns the
block's draft tokens and the collectives it ran."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from types import SimpleNamespace

import torch

PAD_VALUE = 7.0  # the head's padding rows: would win an unmasked pick


def drafter(vocab: int, hidden: int, rank: int, dtype, seed: int, ties: bool,
            scale: float = 1.0, nan_column: int | None = None, d2t: bool = False):
    """A module with Qwen3DSparkForCausalLM's compute_draft_logits, markov_embed,
    markov_bias and map_draft_to_target over seeded weights (ties: integer ones)."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.qwen3_dspark import (DSparkMarkovHead,
                                                         Qwen3DSparkForCausalLM as Q)

    class Drafter(torch.nn.Module):
        compute_draft_logits, markov_embed = Q.compute_draft_logits, Q.markov_embed
        markov_bias, map_draft_to_target = Q.markov_bias, Q.map_draft_to_target
        compute_logits = Q.compute_logits  # unused by the block; what finds the head

    g = torch.Generator().manual_seed(seed)

    def weights(rows, cols, scale_):
        if ties:
            return torch.randint(-1, 2, (rows, cols), generator=g).float()
        return torch.randn(rows, cols, generator=g) * scale_

    d = Drafter()
    d.lm_head = ParallelLMHead(vocab, hidden, params_dtype=dtype)
    d.logits_processor = LogitsProcessor(vocab, scale=scale)
    d.model = torch.nn.Module()
    d.model.markov_head = head = DSparkMarkovHead(vocab, vocab, rank, prefix="markov_head")
    full = weights(vocab, hidden, hidden ** -0.5)
    if nan_column is not None:
        full[nan_column] = float("nan")
    idx = d.lm_head.shard_indices
    n = idx.org_vocab_end_index - idx.org_vocab_start_index
    with torch.no_grad():
        d.lm_head.weight.fill_(PAD_VALUE)
        d.lm_head.weight[:n] = full[idx.org_vocab_start_index:idx.org_vocab_end_index]
        head.markov_w1.weight.copy_(weights(vocab, rank, 1.0))
        head.markov_w2.weight.fill_(PAD_VALUE)
        head.markov_w2.weight[:vocab] = weights(vocab, rank, rank ** -0.5)
    head.to(dtype)
    for layer in (d.lm_head, head.markov_w2):
        layer.quant_method.process_weights_after_loading(layer)
    # a draft vocab inside a larger target vocab (ids k -> k + d2t[k], increasing)
    d.draft_id_to_target_id = (torch.arange(vocab) // 7) if d2t else None
    return d


def speculator(model, reqs: int, positions: int, seed: int):
    """A DSparkSpeculator with only the attributes _sample_sequential reads (greedy
    drafting, no confidence head): anchors and sample indices for `reqs` requests."""
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    class Speculator(DSparkSpeculator):  # nothing built
        capture = init_cudagraph_manager = load_draft_model = propose = None

    vocab = model.logits_processor.org_vocab_size
    g = torch.Generator().manual_seed(seed)
    s = Speculator.__new__(Speculator)
    n = reqs * positions
    s.model, s.num_speculative_steps = model, positions
    s.sample_indices = torch.randperm(n, generator=g)
    s.sample_idx_mapping = torch.arange(n, dtype=torch.int32)
    s.sample_pos = torch.arange(n, dtype=torch.int64) + 1
    s._anchor_idx = torch.arange(reqs, dtype=torch.int64) * positions
    s.input_buffers = SimpleNamespace(input_ids=torch.randint(0, vocab, (n,), generator=g))
    s.draft_tokens = torch.zeros(reqs, positions, dtype=torch.int64)
    s._step_cols = torch.arange(positions, dtype=torch.int32)
    s.use_confidence_head = s._fuse_markov_bias = False
    s._draft_topk = s.draft_logits = s.acceptance_estimator = None
    s.draft_token_confidence_probs = s.temperature = None
    return s


def run_block(spec, hidden: torch.Tensor, sample_sequential) -> tuple[torch.Tensor, list]:
    """(the block's draft tokens, [(collective, shapes)]) of one
    ``sample_sequential(spec, reqs, hidden)`` call."""
    from commfold.distributed.comm_log import record_collectives

    spec.draft_tokens.zero_()
    with record_collectives() as log:
        sample_sequential(spec, spec.draft_tokens.shape[0], hidden)
    return spec.draft_tokens.clone(), [(e.name, e.shapes) for e in log.events]


@contextmanager
def commfold_lines():
    """The commfold log lines of this rank while inside (a list, filled as logged)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger, keep = logging.getLogger("commfold"), Keep()
    logger.setLevel(logging.INFO)
    logger.addHandler(keep)
    try:
        yield lines
    finally:
        logger.removeHandler(keep)
