"""Model Runner V2's Sampler for a sampled step, from this rank's logits shard: the
token V2's ``Sampler.sample`` draws, bit for bit, without the full-vocab all-gather.

V2 processes the logits row (``apply_sampling_params``: logits processors, then
temperature, then min_p) and draws with Gumbel-max (``gumbel_sample``), whose noise
is a hash of (seed, position, token id). Every step is V2's own code run on the
shard's real columns, or needs one small exchange:

- a float32 copy of the shard, as V2 copies the row, when a request needs processing,
  and V2's processing on it (commfold.vllm.sample.sampling_params);
- the draw: commfold.vllm.sample.shard_gumbel (V2's ``gumbel_noised_argmax`` with the global
  token ids as keys), then one all-gather of a (value bits, token id) int64 pair per
  row per rank and the first maximum over ranks - V2's first maximum over the row
  (commfold.shard.payload.first_max).

A row holding NaN on any rank (the gathered values say so, alike on every rank)
makes ``draw`` return None: the step is gathered and V2's samplers pick it. What a
step may ask for here is decided by commfold.vllm.target.decision.decide_v2 (``SAMPLED``).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import torch

from commfold.distributed.collectives import communicator
from commfold.shard import payload
from commfold.vllm.compat import hook_points, runtime
from commfold.vllm.observe import step_log
from commfold.vllm.sample import sampling_params
from commfold.vllm.target import switch
from commfold.vllm.compat import pins
from commfold.vllm.target.logits_head import LogitsHead

log = logging.getLogger("commfold")

HOOK = "target pick: sampled steps"
_S = "vllm.v1.worker.gpu.sample."
# what draw() repeats of V2 on a shard, each function's whole source pinned per release
# (pins.json): any change sends sampled steps back to V2, with a line
_SOURCES = (
    "sampler:Sampler.apply_sampling_params",
    "sampler:Sampler.sample",
    "gumbel:gumbel_noised_argmax",
    "gumbel:gumbel_block_argmax",
    "penalties:PenaltiesState.apply",
    "penalties:apply_penalties",
    "penalties:_penalties_kernel",
    "min_p:apply_min_p",
    "min_p:_min_p_kernel",
    "logit_bias:LogitBiasState.apply",
    "logit_bias:apply_logit_bias",
    "logit_bias:_bias_kernel",
    "bad_words:BadWordsState.apply",
    "bad_words:apply_bad_words",
    "bad_words:_bad_words_kernel",
    "thinking_budget:ThinkingBudgetState.apply",
    "thinking_budget:apply_thinking_budget",
    "thinking_budget:_thinking_budget_kernel",
    "states:SamplingStates.apply_temperature",
    "states:SamplingStates.apply_min_p",
)
_OPS = "vllm.v1.sample.ops."
# what the top-k / top-p bounds were read from (commfold.shard.bounds): the
# kernel's search and cut, the wrappers choosing it, V2's choice of a fused sampler
_CUT_SOURCES = (
    _OPS + "topk_topp_sampler:apply_top_k_top_p",
    _OPS + "topk_topp_sampler:apply_top_k_top_p_pytorch",
    _OPS + "topk_topp_triton:apply_top_k_top_p_triton",
    _OPS + "topk_topp_triton:_topk_topp_kernel",
    _OPS + "topk_topp_triton:_update_min_larger_stats",
    _S + "states:SamplingStates.apply_top_k_top_p",
    _S + "states:SamplingStates.get_top_k_top_p",
    _S + "sampler:Sampler._sample_random",
)
POINTS = tuple((_S + where, pins.pinned(_S + where)) for where in _SOURCES) + tuple(
    (where, pins.pinned(where)) for where in _CUT_SOURCES) + tuple(
    # the kernel's tiles (commfold.shard.bounds.block_size)
    (_OPS + "topk_topp_triton:", f"block_size, block_size_trunc, num_warps = {tiles}")
    for tiles in ("256, 128, 4", "4096, 2048, 4", "8192, 4096, 8")) + (
    # which rows its launch leaves to the split pipeline (commfold.vllm.sample.shard_edge_rows)
    (_OPS + "topk_topp_triton:", "split_covers_ponly = (\n        current_"
     "platform.is_cuda_alike()\n        and topp_enabled\n        and batch_size <= "
     "_SPLIT_MAX_BATCH\n    )"),)


def state(environ=os.environ, runner=None) -> runtime.HookState:
    """Whether sampled V2 steps can be drawn on the shards (the target pick's own
    switch, COMMFOLD_TARGET_PICK, turns them off with it)."""
    return switch.mode_state(HOOK, POINTS, environ, runner)


def install(environ=os.environ, runner=None) -> bool:
    """Nothing to wrap (the V2 target pick calls draw()): logs the one line."""
    return state(environ, runner).log().on


def uninstall() -> None:
    """Nothing was wrapped."""


@functools.cache  # read once per process, as the plugin reads its options
def fused_on_gumbel() -> bool:
    """The user's option (Config.fused_sampler_steps, COMMFOLD_FUSED_SAMPLER_STEPS):
    take steps V2 would draw with a fused top-k / top-p sampler on its Gumbel path."""
    from commfold.vllm.graph_passes import config_from_env

    try:
        return config_from_env().fused_sampler_steps == "gumbel"
    except ValueError:  # the plugin said what to fix when it read the options
        return False


@functools.cache  # vLLM's code does not change within a process
def refusal() -> str | None:
    """Why sampled steps stay V2's in this process (a point moved), else None."""
    gone = hook_points.missing(POINTS)
    if not gone:
        return None
    log.warning("commfold: %s off: vLLM changed what the draw repeats: %s", HOOK,
                "; ".join(gone))
    return f"vLLM changed {gone[0].split(' ')[0]} (commfold doctor)"


class Drawn(NamedTuple):
    tokens: torch.Tensor  # [rows] int64: V2's sampled token per logits row
    processed: torch.Tensor  # [rows, shard]: the processed shard (V2's processed_logits)


def draw(sampler, head: LogitsHead, shard: torch.Tensor, input_batch) -> Drawn | str:
    """V2's sampled tokens for the step from this rank's `shard` [rows, head.shard], or
    why the step goes to V2's samplers (NAN: a row holds NaN; a top-k / top-p cut
    that could not be settled) - every rank alike. A row whose draw hangs on the
    cut's edge is made whole, cut by vLLM's kernel and drawn over the whole row
    (commfold.vllm.sample.shard_edge_rows). Every rank calls it together."""
    import numpy as np  # not at import: commfold imports without numpy

    from commfold.shard import bounds as shard_bounds
    from commfold.shard import edges
    from commfold.vllm.sample import shard_edge_rows, shard_gumbel

    comm = communicator(head.comm)
    start = comm.rank() * head.shard
    n_local = max(0, min(head.shard, head.vocab - start))
    idx_np = input_batch.idx_mapping_np
    mapping = input_batch.expanded_idx_mapping
    pos = input_batch.positions[input_batch.logits_indices]
    states = sampler.sampling_states
    processed = shard
    if np.any(sampler.needs_logits_processing[idx_np]):
        buf = torch.empty(shard.shape[0], head.shard + 1, dtype=torch.float32,
                          device=shard.device)  # one spare column for min_p
        buf[:, :head.shard].copy_(shard)
        if not sampling_params.process(sampler, buf, n_local, start, input_batch, comm):
            return NAN
        processed = buf[:, :head.shard]
    work = processed[:, :n_local]
    near = None
    if sampling_params.truncates(states, idx_np):  # V2's top-k / top-p: bounds of its cut
        bounds = shard_bounds.cut(comm, work, states.top_k.gpu[mapping],
                                  states.top_p.gpu[mapping], head.vocab, head.shard)
        if isinstance(bounds, str):
            return bounds
        near = bounds.between(work)
        work = torch.where(bounds.below(work), float("-inf"), work)

    def maxima(logits):
        return shard_gumbel.block_maxima(
            logits, start, mapping, states.temperature.gpu, states.seeds.gpu, pos,
            bool(getattr(sampler, "use_fp64_gumbel", False)))

    value, index = maxima(work)
    value = value.masked_fill(processed[:, :n_local].isnan().any(-1), float("nan"))
    rival = None if near is None else maxima(near)[0]
    got = payload.first_max(comm, value, index, rival)
    if got is None:
        return NAN
    tokens, edge = got
    if edge is not None and bool(edge.any()):  # from gathered values: every rank alike
        which = edge.nonzero()[:, 0]
        why = shard_edge_rows.refusal(len(which), len(edge), shard.element_size())
        if why is not None:
            return why
        # those rows made whole, cut by vLLM's kernel, drawn over the row as V2 draws
        whole = edges.whole(comm, processed[:, :n_local], which, head.shard, head.vocab)
        cut = shard_edge_rows.cut(whole, which, states, input_batch, len(edge))
        tokens[which] = shard_gumbel.block_maxima(
            cut, 0, mapping[which], states.temperature.gpu, states.seeds.gpu, pos[which],
            bool(getattr(sampler, "use_fp64_gumbel", False)))[1]
        step_log.note(shard_edge_rows.NOTE_KEY, shard_edge_rows.note(len(which)))
    return Drawn(tokens, processed)


NAN = "NaN logits: V2's own pick"
