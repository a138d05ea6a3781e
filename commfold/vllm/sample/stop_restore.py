"""V2's stop-token restore on a logits shard: min_tokens on a structured-output request.

V2's logit-bias kernel (``_bias_kernel``), for a request with min_tokens, stop tokens
and structured output (``restore_when_all_masked``), masks the stop tokens while the
request is inside its min_tokens, then scans the whole row: where every logit is -inf
(the grammar allowed only stop tokens) it writes back the stop tokens' finite logits.
On a shard: V2's kernel without stop ids on a copy (the stop logits after allowed ids
and bias), V2's kernel as usual (stop tokens masked), then the row's maximum over
every rank from one all-gather of a float32 per row per rank, and the stop tokens in
the shard restored from the copy where that maximum is -inf. A row holding NaN has a
NaN maximum here (no restore) and is the draw's to give to V2 whole
(commfold.vllm.sample.sampled_pick: NaN rows go to V2's samplers), so its token is V2's.
What this repeats of V2 (``_bias_kernel``, ``LogitBiasState.apply``) is pinned by
whole source with the sampled draw's points (sampled_pick.POINTS).
"""
from __future__ import annotations

import torch


def restoring(bias, idx_np) -> bool:
    """Whether a request of the step has V2's restore (V2's per-request flags: alike
    on every rank)."""
    import numpy as np

    return bool(np.any(bias.restore_when_all_masked.np[idx_np]))


def restore(bias, work: torch.Tensor, saved: torch.Tensor, start: int, input_batch,
            comm) -> None:
    """V2's restore on this rank's columns `work` [rows, n] (stop tokens masked by V2's
    kernel), the stop logits from `saved` (V2's kernel without stop ids); comm: the TP
    group's communicator. Every rank calls it together."""
    rows = input_batch.expanded_idx_mapping.long()
    pos = input_batch.positions[input_batch.logits_indices].long()
    n = work.shape[1]
    local = work.amax(-1) if n else work.new_full(work.shape[:1], float("-inf"))
    most = comm.all_gather(local.float().contiguous()).view(comm.world_size(), -1).amax(0)
    # V2's kernel: restoring request, inside min_tokens with stop ids, row all -inf
    masked = bias.restore_when_all_masked.gpu[rows].bool() & \
        (pos + 1 < bias.min_lens.gpu[rows].long()) & \
        (bias.num_stop_token_ids.gpu[rows] > 0) & (most == float("-inf"))
    stops = torch.zeros_like(work, dtype=torch.bool)
    for r in masked.nonzero()[:, 0].tolist():
        slot = int(rows[r])
        ids = bias.stop_token_ids.gpu[slot, :int(bias.num_stop_token_ids.gpu[slot])].long()
        stops[r, ids[(ids >= start) & (ids < start + n)] - start] = True
    work.copy_(torch.where(stops & saved.isfinite(), saved, work))
