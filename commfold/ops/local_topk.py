"""commfold::local_topk - the k largest logits (values, global indices) over
vocab-sharded logits without gathering them.

Each rank takes the top k of its valid columns (padding past the true vocab masked
out; a rank holding only padding offers nothing), the ranks exchange k (key, value)
pairs per row in one collective, and the top k keys over ranks win.

Order: descending value, equal values lowest index first - the order of
``torch.sort(descending=True, stable=True)``. torch.topk's order among equal values
is unspecified (on CPU it varies with the row length), so commfold's indices equal
torch.topk's whenever the row has no ties among its top k, and otherwise point at the
same values. NaN counts as the largest value (as in torch.topk and torch.sort).

Exactness: each candidate gets a unique int64 key, (ordered value bits << 32) |
(2^32 - 1 - global index); comparing keys is comparing (value, -index), so the merge
is exact and deterministic. Local candidates come from a float topk (fast); a row
whose k-th place falls inside a group of equal values (or is NaN) is redone with
keys over its whole row. -0.0 and +0.0 share a key's value bits
(torch compares them equal), every NaN gets the largest ones; the values returned are
the original columns' bits (signed zeros and NaN payloads survive).

On CPU the whole op is C++ (commfold.ops.vocab_scan: a one-pass top-k scan, the pair
gather on a c10d group or vLLM's shared memory, the merge); elsewhere, and for other
communicators, the torch implementation below (same keys, same answer).
"""
from __future__ import annotations

import torch

from commfold.distributed.collectives import communicator
from commfold.ops import chain_encoding, vocab_scan
from commfold.ops.vocab_slice import local_width

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

# float64 has no room for an index next to its 64 value bits in one int64 key.
SUPPORTED_DTYPES = tuple(_BITS)
_LOW = (1 << 32) - 1
_NONE = torch.iinfo(torch.int64).min  # below every real key (see _keys)


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 per element, in the same order as x's values under torch.topk's rule:
    -0.0 == +0.0, every NaN above +inf."""
    bits_dtype = _BITS[x.dtype]
    top = torch.iinfo(bits_dtype).max  # the magnitude mask, 0x7fff...
    b = x.view(bits_dtype).to(torch.int64)
    b = torch.where(b < 0, b ^ top, b)  # negatives: larger magnitude -> smaller
    b = torch.where(x == 0, torch.zeros_like(b), b)  # -0.0 is +0.0
    return torch.where(x.isnan(), torch.full_like(b, top), b)


def _keys(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys: larger value first, then lower global index first. The
    smallest real key is above int64 min (value bits > int32/int16 min)."""
    return (ordered_bits(values) << 32) + (_LOW - index)


def _local_top(cols: torch.Tensor, k: int, first_index: int):
    """(keys, values) of the k best columns of each row under (value desc, index
    asc). A float topk finds them (fast); only rows where a group of equal values
    straddles the k-th place (topk may keep any of them), or whose k-th value is NaN
    (NaN != NaN), are redone with keys over the whole row."""
    values, where = torch.topk(cols, k, dim=-1)
    kth = values[:, -1:]
    redo = ((cols == kth).sum(-1) > (values == kth).sum(-1)) | kth.squeeze(-1).isnan()
    if bool(redo.any()):
        rows = redo.nonzero().squeeze(-1)
        index = torch.arange(first_index, first_index + cols.shape[-1], dtype=torch.int64,
                             device=cols.device)
        _, where_exact = torch.topk(_keys(cols[rows], index), k, dim=-1)
        where = where.index_put((rows,), where_exact)
        values = cols.gather(-1, where)
    return _keys(values, where + first_index), values


# torch.library.Library, not custom_op: a call costs ~3 us, not ~11 us (vocab_scan
# registers the CPU kernel in C++; this module's Python is the other devices' path).
_SCHEMA = ("(Tensor shard, SymInt? valid_vocab, str comm, SymInt k, float[]? chain=None)"
           " -> (Tensor, Tensor)")
_lib = torch.library.Library("commfold", "FRAGMENT")


def local_topk(shard: torch.Tensor, valid_vocab: int | None, comm: str, k: int,
               chain: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, global indices) of the k largest entries of the last dim of
    gathered[..., :valid_vocab], the ranks' shards [..., Vs] concatenated in rank
    order (chain applied first, values rounded to its dtype); sorted descending, ties
    lowest index first. valid_vocab is a slice end with Python's rules (negative
    counts from the end); None keeps all columns. Every rank of `comm` calls it."""
    return torch.ops.commfold.local_topk.default(shard, valid_vocab, comm, k, chain)


def local_topk_eager(shard, valid_vocab, comm, k, chain=None):
    """The torch implementation (any device, any communicator)."""
    c = communicator(comm)
    vocab_scan.note_communicator(c)
    world, rank = c.world_size(), c.rank()
    vs = shard.shape[-1]
    total, n_local = local_width(valid_vocab, world, rank, vs)
    if not 0 <= k <= total:  # every rank sees the same total: all raise, none gathers
        raise RuntimeError("commfold.local_topk: selected index k out of range "
                           "(the original program's topk raises here too)")
    out = chain_encoding.out_dtype(chain, shard.dtype)
    lead = shard.shape[:-1]
    rows = shard.reshape(-1, vs)
    pack = torch.full((rows.shape[0], k, 2), _NONE, dtype=torch.int64, device=shard.device)
    take = min(k, n_local)
    if take > 0:
        cols = rows[:, :n_local]
        if chain:  # topk compares the chain's values as stored in its dtype
            cols = chain_encoding.stored(chain_encoding.apply(cols, chain), out)
        keys, values = _local_top(cols, take, rank * vs)
        pack[:, :take, 0] = keys
        pack[:, :take, 1] = values.view(_BITS[out]).to(torch.int64)
    packs = c.all_gather(pack).view(world, rows.shape[0], k, 2)
    packs = packs.permute(1, 0, 2, 3).reshape(rows.shape[0], world * k, 2)
    keys, where = torch.topk(packs[..., 0], k, dim=-1)  # total >= k: no _NONE wins
    bits = packs[..., 1].gather(-1, where).to(_BITS[out])
    values = bits.view(out).reshape(*lead, k)
    indices = (_LOW - (keys & _LOW)).reshape(*lead, k)
    return values, indices



def _fake(shard, valid_vocab, comm, k, chain=None):
    shape = list(shard.shape[:-1]) + [k]
    return (shard.new_empty(shape, dtype=chain_encoding.out_dtype(chain, shard.dtype)),
            shard.new_empty(shape, dtype=torch.int64))


vocab_scan.register_op(_lib, "local_topk", _SCHEMA, local_topk_eager, _fake)
