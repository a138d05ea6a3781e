"""Model Runner V2's structured-output grammar bitmask on this rank's logits shard.

V2 masks a structured-output request's logits rows before its samplers
(``GPUModelRunner.sample`` calls ``StructuredOutputsWorker.apply_grammar_bitmask``
on the full-vocab logits): the scheduler's bitmask is packed int32 [rows,
ceil(vocab / 32)], token t allowed where bit t % 32 of word t // 32 is set, and V2's
``_apply_grammar_bitmask_kernel`` writes -inf at every column whose bit is clear.
Each column's outcome depends on its own bit only, so the shard's columns are masked
here by V2's own method, given the shard's columns [start, start + n) as its logits
and the bitmask re-packed for them (``commfold.shard.columns.shard_mask``: a shard starting
inside a 32-token word is shifted across words). The masked shard then equals V2's
masked row's columns bit for bit, and V2's greedy argmax / Gumbel draw over it is
what commfold.vllm.sample.sampled_pick and local_argmax repeat. No collective.

Under spec decoding V2 masks every draft position's row the same way (its worker maps
the bitmask rows) and verifies the masked rows, up to vLLM 0.33 with the drafts its
grammar did not constrain set to -1 (``grammar_invalid_drafts``, passed to commfold's
verification as to V2's). min_tokens on a structured-output request, whose stop
tokens V2 restores on a row the grammar masked whole, is commfold.vllm.sample.stop_restore's.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from commfold.distributed.collectives import communicator
from commfold.shard.columns import shard_mask
from commfold.vllm.compat import hook_points, pins, runtime
from commfold.vllm.observe import step_log
from commfold.vllm.target import switch
from commfold.vllm.target.logits_head import LogitsHead

_S = "vllm.v1.worker.gpu.structured_outputs:"
# what the shard's mask rests on, each function's whole source per release: V2's
# method maps bitmask rows to logits rows and masks columns [0, logits.shape[-1])
# of the logits it is given, column by column
POINTS = (
    (f"{_S}StructuredOutputsWorker.apply_grammar_bitmask",
     pins.pinned(f"{_S}StructuredOutputsWorker.apply_grammar_bitmask")),
    (f"{_S}_apply_grammar_bitmask_kernel", pins.pinned(f"{_S}_apply_grammar_bitmask_kernel")),
    ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample",
     "self.structured_outputs_worker.apply_grammar_bitmask("),
)
NOTE = "bitmask on the shard"  # the step log's "grammar" entry for a masked shard
HOOK = "target pick: structured output"


def state(environ=os.environ, runner=None) -> runtime.HookState:
    """Whether structured-output V2 steps can be masked on the shards (the target
    pick's own switch, COMMFOLD_TARGET_PICK, turns them off with it)."""
    return switch.mode_state(HOOK, POINTS, environ, runner)


def install(environ=os.environ, runner=None) -> bool:
    """Nothing to wrap here (the V2 target pick's hook sets call apply()): logs the
    one line."""
    return state(environ, runner).log().on


def uninstall() -> None:
    """Nothing was wrapped."""

log = logging.getLogger("commfold")


@functools.cache  # vLLM's code does not change within a process
def refusal() -> str | None:
    """Why structured-output steps stay V2's in this process (a point moved), else
    None; logged once."""
    gone = hook_points.missing(POINTS)
    if not gone:
        return None
    log.warning("commfold: structured output on the shards off: vLLM changed %s",
                "; ".join(gone))
    return f"structured output: vLLM changed {gone[0].split(' ')[0]} (commfold doctor)"


def apply(apply_bitmask, head: LogitsHead, shard: torch.Tensor, input_batch,
          request_ids: list, bitmask) -> None:
    """Mask this rank's `shard` [rows, head.shard] in place as V2 masks the full row:
    apply_bitmask is V2's StructuredOutputsWorker.apply_grammar_bitmask (bound, or
    the original a hook wraps), called with the shard's real columns."""
    if not request_ids or shard.shape[0] == 0:
        return
    start = communicator(head.comm).rank() * head.shard
    n = max(0, min(head.shard, head.vocab - start))
    if n:
        apply_bitmask(shard[:, :n], input_batch, request_ids, shard_mask(bitmask, start, n))
    step_log.note("grammar", NOTE)

