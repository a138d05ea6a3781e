"""V2's processing of a sampled step's logits (``Sampler.apply_sampling_params``) on
one rank's vocab shard, in V2's order, with V2's own kernels: what the sampled draw
(commfold.vllm.sample.sampled_pick) and the sampled verification
(commfold.vllm.spec_decode.shard_verify) both run before they read a row.

- logit_bias, allowed_token_ids, min_tokens: V2's ``apply_logit_bias`` kernel on the
  shard, each request's token id lists cut to the shard's ids (as shard columns); a
  structured request's stop tokens restored on a row masked whole as V2 restores them
  (commfold.vllm.sample.stop_restore: one all-gather of the row maxima);
- penalties: V2's ``apply_penalties`` kernel on the shard, its per-request statistics
  (output counts, the prompt's packed bit mask) sliced to the shard's columns - the
  bit mask re-packed when the shard does not start on a 32-token word;
- bad words: V2's ``apply_bad_words`` kernel finds the matched words (on a probe with
  one column per word), their last tokens in the shard are masked;
- a thinking budget: V2's ``ThinkingBudgetState.apply`` on a probe as wide as the
  largest end-marker id + 1 shows each row's forced marker, set in the shard;
- temperature: V2's ``SamplingStates.apply_temperature`` (elementwise);
- min_p: V2's ``apply_min_p`` kernel takes the row maximum itself; it is given the
  shard with one more column holding the maximum over all ranks (one all-gather of a
  float32 per row per rank), so it computes V2's threshold and masks as V2 does.

The functions it repeats are pinned with the draw (sampled_pick.POINTS).
"""
from __future__ import annotations

import torch

from commfold.shard import columns
from commfold.vllm.sample import stop_restore


def truncates(states, idx_np) -> bool:
    """Whether V2 applies top-k or top-p to a request of the step (its own test)."""
    return bool((states.top_k.np[idx_np] != states.vocab_size).any()
                or (states.top_p.np[idx_np] != 1.0).any())


def process(sampler, buf, n_local: int, start: int, input_batch, comm,
            ids: torch.Tensor | None = None) -> bool:
    """V2's apply_sampling_params on this rank's columns buf[:, :n_local] (float32),
    in V2's order, but its top-k / top-p; False where min_p's row maxima hold NaN.
    ids: the token of each logits row V2 passes its processors (the batch's input ids
    at the logits rows; V2's verification passes its draft tokens, -1 where a draft
    is a placeholder)."""
    import numpy as np  # not at import: commfold imports without numpy

    if ids is None:
        ids = input_batch.input_ids[input_batch.logits_indices]
    idx_np = input_batch.idx_mapping_np
    mapping = input_batch.expanded_idx_mapping
    work = buf[:, :n_local]
    bias = _state(sampler, "LogitBiasState")
    if bias is not None and np.any(bias.use_logit_bias[idx_np]):
        saved = work.clone() if stop_restore.restoring(bias, idx_np) else None
        if n_local and saved is not None:  # the stop logits V2 may restore
            _logit_bias(bias, saved, start, input_batch, stops=False)
        if n_local:
            _logit_bias(bias, work, start, input_batch)
        if saved is not None:  # every rank alike (V2's per-request flags)
            stop_restore.restore(bias, work, saved, start, input_batch, comm)
    penalties = sampler.penalties_state
    if n_local and np.any(penalties.use_penalty[idx_np]):
        from vllm.v1.worker.gpu.sample.penalties import apply_penalties

        # V2's kernel counts each row's earlier drafts by column: ids as shard columns
        apply_penalties(work, mapping, ids - start, input_batch.expanded_local_pos,
                        penalties.repetition_penalty.gpu, penalties.frequency_penalty.gpu,
                        penalties.presence_penalty.gpu,
                        columns.shard_bits(penalties.prompt_bin_mask, start, n_local, idx_np),
                        penalties.output_bin_counts[:, start:start + n_local])
    bad_words = _state(sampler, "BadWordsState")
    if n_local and bad_words is not None and np.any(bad_words.num_bad_words.np[idx_np]):
        _bad_words(bad_words, work, start, input_batch, ids)
    budget = getattr(sampler, "thinking_budget_state", None)
    if budget is not None and budget.enabled and np.any(budget.use_thinking_budget[idx_np]):
        _thinking_budget(budget, work, start, input_batch, ids)
    states = sampler.sampling_states
    if n_local:
        states.apply_temperature(work, mapping, idx_np)
    if np.all(states.min_p.np[idx_np] == 0.0):
        return True
    # V2's min_p kernel over this rank's columns and one holding the row's maximum
    local = work.amax(-1) if n_local else buf.new_full(buf.shape[:1], float("-inf"))
    maxima = comm.all_gather(local).view(comm.world_size(), -1)
    if bool(maxima.isnan().any()):
        return False
    from vllm.v1.worker.gpu.sample.min_p import apply_min_p

    buf[:, n_local] = maxima.amax(0)
    apply_min_p(buf[:, :n_local + 1], mapping, states.min_p.gpu)
    return True


def _state(sampler, name: str):
    """V2's built-in logits processor of class `name` in the Sampler's pipeline."""
    return next((p for p in sampler.logits_processors if type(p).__name__ == name), None)


def _logit_bias(bias, work, start: int, input_batch, stops: bool = True) -> None:
    """V2's apply_logit_bias on this rank's columns: its allowed ids, biased ids and
    min_tokens stop ids kept per request where they fall in the shard, as shard
    columns. A request whose allowed ids all lie elsewhere gets the spare column
    past the shard (V2's kernel then masks every shard column, as on the full row).
    stops=False: without min_tokens' stop ids (V2's restore of all-masked rows,
    structured output with min_tokens: commfold.vllm.sample.stop_restore)."""
    import numpy as np

    from vllm.v1.worker.gpu.sample.logit_bias import apply_logit_bias

    n = work.shape[1]
    slots = np.unique(input_batch.idx_mapping_np)
    allowed_n, allowed, _ = columns.shard_ids(bias.num_allowed_token_ids.np,
                                              bias.allowed_token_ids.gpu, slots, start, n,
                                              spare=True)
    bias_n, bias_ids, values = columns.shard_ids(bias.num_logit_bias.np,
                                                 bias.logit_bias_token_ids.gpu, slots, start,
                                                 n, values=bias.logit_bias.gpu)
    stop_n, stop_ids, _ = columns.shard_ids(bias.num_stop_token_ids.np, bias.stop_token_ids.gpu,
                                            slots, start, n)
    stop_n = stop_n if stops else torch.zeros_like(stop_n)
    apply_logit_bias(work, input_batch.expanded_idx_mapping,
                     input_batch.positions[input_batch.logits_indices], allowed_n, allowed,
                     bias_n, bias_ids, values, bias.min_lens.gpu, stop_n,
                     bias.restore_when_all_masked.gpu, stop_ids)


def _bad_words(state, work, start: int, input_batch, ids: torch.Tensor) -> None:
    """V2's bad words on this rank's columns. V2's kernel writes -inf at a matched
    word's last token, a global id; here V2's own kernel finds the matches on a probe
    [rows, words] - each word's last token replaced by its index, so a match writes
    -inf at the word's column - and the matched words' last tokens in the shard are
    set to -inf."""
    import numpy as np

    from vllm.v1.worker.gpu.sample.bad_words import apply_bad_words

    idx_np = input_batch.idx_mapping_np
    slots = np.unique(idx_np)
    most = int(state.num_bad_words.np[idx_np].max())
    table, offsets = state.bad_word_token_ids.gpu, state.bad_word_offsets.gpu
    probe_ids = table.clone()
    lasts = torch.zeros(table.shape[0], most, dtype=torch.int64, device=table.device)
    for slot in slots:
        words = int(state.num_bad_words.np[slot])
        ends = offsets[slot, 1:words + 1].long() - 1
        lasts[slot, :words] = table[slot, ends].long()
        probe_ids[slot, ends] = torch.arange(words, dtype=table.dtype, device=table.device)
    mapping = input_batch.expanded_idx_mapping
    probe = work.new_zeros(work.shape[0], most)
    req = state.req_states
    apply_bad_words(probe, mapping, probe_ids, offsets, state.num_bad_words.gpu,
                    req.all_token_ids.gpu, req.prompt_len.gpu, req.total_len.gpu, ids,
                    input_batch.expanded_local_pos, most)
    rows, words = (probe == float("-inf")).nonzero(as_tuple=True)
    tokens = lasts[mapping[rows].long(), words] - start
    here = (tokens >= 0) & (tokens < work.shape[1])
    work[rows[here], tokens[here]] = float("-inf")


def _thinking_budget(state, work, start: int, input_batch, ids: torch.Tensor) -> None:
    """V2's thinking-budget forcing on this rank's columns. V2's kernel stores 1e9 at
    a row's forced end-marker token (a global id) once its reasoning is over budget,
    and nothing else; here V2's own ``ThinkingBudgetState.apply`` (its marker cache
    update included, on every rank as on V2's) runs on a zero probe as wide as the
    largest marker id + 1 (bfloat16: any store reads nonzero), and each row's forced
    marker is stored in the shard where it falls there."""
    from types import SimpleNamespace

    ends = state.reasoning_end_token_ids.long()
    probe = torch.zeros(work.shape[0], int(ends.max()) + 1, dtype=torch.bfloat16,
                        device=work.device)
    ctx = SimpleNamespace(  # the LogitsContext fields apply() reads
        idx_mapping=input_batch.idx_mapping, idx_mapping_np=input_batch.idx_mapping_np,
        expanded_idx_mapping=input_batch.expanded_idx_mapping, input_ids=ids,
        expanded_local_pos=input_batch.expanded_local_pos)
    state.apply(probe, ctx)
    rows, which = (probe[:, ends] != 0).nonzero(as_tuple=True)
    cols = ends[which] - start
    here = (cols >= 0) & (cols < work.shape[1])
    work[rows[here], cols[here]] = 1.0e9
