"""Which of a rank's vocab columns are real: the one home of the slice-end rule the
local selection ops share (local_argmax, local_topk, softmax statistics)."""
from __future__ import annotations


def slice_end(end: int | None, width: int) -> int:
    """Where ``gathered[..., :end]`` stops in a row of `width` columns: Python's slice
    rules (a negative end counts from the end, clamped to [0, width]); None: width."""
    if end is None:
        return width
    return max(0, min(width, end if end >= 0 else width + end))


def local_width(valid_vocab: int | None, world: int, rank: int, vs: int) -> tuple[int, int]:
    """(total valid columns of the gathered row, how many of them this rank's shard of
    vs columns holds - 0 for a rank that holds only padding)."""
    total = slice_end(valid_vocab, world * vs)
    return total, max(0, min(vs, total - rank * vs))
