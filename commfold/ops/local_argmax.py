"""commfold::local_argmax - greedy pick over vocab-sharded logits without gathering them.

Each rank takes the first maximum of its valid columns (padding past the true vocab
masked out), the ranks exchange one (value, global index) pair per row, and the
first maximum over ranks wins. Shards are contiguous in rank order, so "first over
ranks, then first within a shard" is exactly torch.argmax's rule on the full row,
NaN included (a NaN is the maximum; the first NaN wins). Values travel bit-cast
inside an int64 pair with their index: one collective, no float round trip of
indices.

``chain`` (commfold.ops.chain_encoding) is an elementwise chain - scale, temperature,
soft-cap - applied to each logit before it is compared, so the shard is read once
(no scaled copy); the value returned is the chain's, in its output dtype.

On CPU the whole op is C++ (commfold.ops.vocab_scan: the scan, the pair gather on a
c10d group or vLLM's shared memory, the combine); elsewhere, and for other
communicators, the torch implementation below. Eager callers (vLLM's sampler, say)
call ``local_argmax(...)`` - a ~3 us dispatcher call plus the scan.
"""
from __future__ import annotations

import torch

from commfold.distributed.collectives import communicator
from commfold.ops import chain_encoding, vocab_scan
from commfold.ops.vocab_slice import local_width

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16, torch.float64: torch.int64}

SUPPORTED_DTYPES = tuple(_BITS)

# torch.library.Library, not custom_op: a call costs ~3 us, not ~11 us (vocab_scan
# registers the CPU kernel in C++; this module's Python is the other devices' path).
_SCHEMA = ("(Tensor shard, SymInt? valid_vocab, str comm, bool keepdim=False, "
           "float[]? chain=None) -> (Tensor, Tensor)")
_lib = torch.library.Library("commfold", "FRAGMENT")


def local_argmax(shard: torch.Tensor, valid_vocab: int | None, comm: str,
                 keepdim: bool = False, chain: list[float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(max value, global argmax) over the last dim of gathered[..., :valid_vocab],
    the ranks' shards [..., Vs] concatenated in rank order (chain applied first).
    valid_vocab is a slice end with Python's rules (negative counts from the end);
    None keeps all columns. Every rank of `comm` calls it together."""
    return torch.ops.commfold.local_argmax.default(shard, valid_vocab, comm, keepdim, chain)


def local_argmax_eager(shard, valid_vocab, comm, keepdim=False, chain=None):
    """The torch implementation (any device, any communicator)."""
    c = communicator(comm)
    vocab_scan.note_communicator(c)
    world, rank = c.world_size(), c.rank()
    vs = shard.shape[-1]
    total, n_local = local_width(valid_vocab, world, rank, vs)
    if total == 0:
        raise RuntimeError("commfold.local_argmax: argmax over an empty vocab slice "
                           "(the original program's argmax raises here too)")
    out = chain_encoding.out_dtype(chain, shard.dtype)
    lead = shard.shape[:-1]
    rows = shard.reshape(-1, vs)
    if n_local > 0 and rows.shape[0] > 0:
        cols = rows[:, :n_local]
        if chain:
            seen = chain_encoding.apply(cols, chain)
            _, index = seen.max(dim=-1)
            value = chain_encoding.stored(seen.gather(-1, index[:, None]).squeeze(-1), out)
        else:
            value, index = cols.max(dim=-1)
    else:  # this rank holds only padding: never chosen over a real column
        value = torch.full(rows.shape[:1], float("-inf"), dtype=out, device=shard.device)
        index = torch.zeros(rows.shape[:1], dtype=torch.int64, device=shard.device)
    pair = torch.stack([value.view(_BITS[out]).to(torch.int64), index + rank * vs], dim=-1)
    pairs = c.all_gather(pair).view(world, -1, 2)
    values = pairs[..., 0].to(_BITS[out]).view(out)  # [world, rows]
    winner = values.argmax(dim=0, keepdim=True)  # first max / first NaN over ranks
    best_value = values.gather(0, winner).reshape(lead)
    best_index = pairs[..., 1].gather(0, winner).reshape(lead)
    if keepdim:
        best_value, best_index = best_value.unsqueeze(-1), best_index.unsqueeze(-1)
    return best_value, best_index



def _fake(shard, valid_vocab, comm, keepdim=False, chain=None):
    shape = list(shard.shape[:-1]) + ([1] if keepdim else [])
    return (shard.new_empty(shape, dtype=chain_encoding.out_dtype(chain, shard.dtype)),
            shard.new_empty(shape, dtype=torch.int64))


vocab_scan.register_op(_lib, "local_argmax", _SCHEMA, local_argmax_eager, _fake)
