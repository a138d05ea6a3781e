"""Speculative decoding: every drafter's pick from its shard, the draft logits cache,
and the verification of drafts (greedy and sampled) from the target's shards."""
