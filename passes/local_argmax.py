"""local_argmax: greedy token selection over vocab-sharded logits without gathering
the logits.

Uses: patterns.gather.VocabGather (the all-gather on the vocab dim, any spelling) and
patterns.greedy.GreedyPick (slice to the valid vocab, monotone elementwise ops, argmax
/ max(dim=-1) / topk(1)).

Why it is safe:
- nothing but the pick reads the gathered logits (the recognizer checks every node
  on the way has one consumer), so the full row need not exist;
- the elementwise ops are replayed on the shard, so each logit the pick compares is
  bit-for-bit the value it compared before (no reliance on monotonicity for
  exactness; monotone-only is kept as the conservative rule);
- shards are concatenated in rank order (checked), so first-max-within-shard then
  first-max-over-ranks is torch's first-max rule; commfold::local_argmax keeps NaN
  as the maximum and masks padding columns past the valid vocab.
- topk(1) becomes first-max too: torch leaves topk's choice among ties unspecified
  (on CPU it varies with the row length); commfold picks the lowest index.
- not taken on CPU when a tanh is on the way (a soft cap): Inductor's CPU kernels
  compute tanh with Sleef where they vectorize and with libm's tanhf where they do
  not, which it decides by the gathered layout (an odd shard width, say); the two
  differ in the last bits (docs/GUARANTEES.md), so no local kernel can know the
  unrewritten program's values (see ``_local_pick.tanh_refusal``). Triton's tanh is one
  function whatever the layout: on GPUs the ops are replayed and the rewrite stays.

Writes (``_local_pick.rewrite_pick``): shard -> replayed ops ->
commfold::local_argmax(., valid_vocab, comm) whose one collective gathers a (value,
index) int64 pair per row per rank. On CPU the ops
(scale, temperature, soft-cap, casts) go into the op as a chain instead of being
replayed: it computes them as Inductor's CPU code would while it reads the shard.
"""
from __future__ import annotations

from commfold.context import PassContext
from commfold.ops.local_argmax import SUPPORTED_DTYPES
from commfold.patterns.gather import after_vocab_gather
from commfold.patterns.greedy import match_greedy

from ._local_pick import PICK_PATTERN, qualified, rewrite_pick

PATTERN = PICK_PATTERN


def run(ctx: PassContext) -> None:
    for pick in qualified(ctx, PATTERN, after_vocab_gather(match_greedy), lambda m: m.pick,
                          SUPPORTED_DTYPES, "logits dtype not supported"):
        rewrite_pick(ctx, pick)
