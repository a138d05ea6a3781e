"""commfold::replicated_embedding and commfold::replicated_lm_head - a vocab-parallel
layer computed on a replicated FULL weight, with no per-step collective.

The full weight is assembled from every rank's shard (in rank order, padding trimmed)
by one build - two all-gathers on the layer's own communicator - and cached. Later
calls reuse it while the shard is unchanged.

When is a shard "changed"? A rebuild is a collective, so every rank must decide it
identically WITHOUT talking. The key is what a tensor-parallel weight update changes on
every rank at once:
- the shard's storage (identity, kept by weak reference, plus offset/shape/stride/
  dtype): a new tensor, ``param.data = new``, a reallocation;
- the shard's autograd version counter: any in-place write through the parameter or
  a view/detach of it (``with torch.no_grad(): p.copy_(w)``, ``load_state_dict``).
Assumption (documented, the same one TP itself makes): weights are (re)loaded on all
ranks of the group together, so every rank sees its own key change before the same
step. A write that bypasses the version counter - ``param.data.copy_(w)``, which is
what vLLM's weight loaders do - and an in-place write to an inference tensor (no
version counter) are invisible to it: call ``invalidate_replicas()`` on every rank
after such a reload (it drops every cached replica; the next call of each
layer rebuilds it, collectively).

Exactness:
- embedding: the replica holds each rank's rows bit for bit; the result is
  ``where(out of range, 0, full[ids]) + 0.0``, i.e. exactly what the sum all-reduce of
  one real row and W-1 zero rows gives (``+ 0.0`` turns -0.0 into +0.0 as that sum
  does). Ids no rank serves (negative, past the vocab, in gaps) give zero rows, as in
  the original program. A NaN entry stays a NaN; its payload bits are whatever the
  float add makes of it, as in any all-reduce (gloo's bf16 sum gives 0x7FC0, torch's
  AVX2 bf16 add 0xFFFF: the original program's bits depend on its backend too).
- LM head: logits are computed block by block with the original shard's row count,
  so each block is the matmul a rank computed before (the last one trimmed of padding
  rows); the logits are within f32 matmul rounding of the original (in the tests:
  bit-equal at TP=4, within 1e-6 at TP=2, where the kernels Inductor picked differ).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from commfold.distributed.collectives import communicator

MAX_SEGMENTS = 8  # id ranges per rank (vLLM uses 2: the base vocab and the added vocab)
_HEADER = 2 + 3 * MAX_SEGMENTS  # [rows, n_segments, (lo, hi, row_start) * MAX_SEGMENTS]


@dataclass
class _Entry:
    storage: weakref.ref
    key: tuple  # storage offset, shape, stride, dtype, version
    full: torch.Tensor


# The cache check is Python that must run on every call: a CUDA graph replay would skip
# it (and a rebuild's collective), so these ops are never captured.
_TAGS = (torch.Tag.cudagraph_unsafe,)
_cache: dict[tuple, _Entry] = {}
_lock = threading.RLock()  # re-entrant: _evict may run from a GC inside a locked block
_builds = 0  # number of builds in this process (tests and the example read it)


def invalidate_replicas() -> None:
    """Drop every cached full weight. Call it on EVERY rank after a weight reload that
    bypasses autograd's version counter (``param.data.copy_``); the next call of each
    replicated layer rebuilds its full weight (a collective on all ranks)."""
    with _lock:
        _cache.clear()


def build_count() -> int:
    return _builds


def cached_bytes() -> int:
    """Bytes held by the cached full weights of this process."""
    with _lock:
        return sum(e.full.numel() * e.full.element_size() for e in _cache.values())


def _version(t: torch.Tensor) -> int:
    """The autograd version counter; -1 for inference tensors (created under
    torch.inference_mode), which have none: their in-place writes need
    invalidate_replicas() like ``.data`` writes do."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _full_weight(kind: str, shard: torch.Tensor, layout: tuple, comm: str, build) -> torch.Tensor:
    storage = shard.untyped_storage()
    slot = (kind, comm, layout, id(storage))
    key = (shard.storage_offset(), tuple(shard.shape), tuple(shard.stride()), shard.dtype,
           _version(shard))
    with _lock:
        entry = _cache.get(slot)
    if entry is not None and entry.storage() is storage and entry.key == key:
        return entry.full
    full = build(communicator(comm), shard)
    global _builds
    _builds += 1

    def _evict(_ref, slot=slot):  # the storage died: its id may be reused
        with _lock:
            if _cache.get(slot) is not None and _cache[slot].storage is _ref:
                del _cache[slot]

    with _lock:
        _cache[slot] = _Entry(weakref.ref(storage, _evict), key, full)
    return full


def _gather_rows(c, shard: torch.Tensor, rows: int) -> torch.Tensor:
    """Every rank's shard padded to `rows` rows, bit-exact, as [world, rows, H]."""
    padded = shard.new_zeros((rows,) + tuple(shard.shape[1:]))
    padded[: shard.shape[0]] = shard
    out = c.all_gather(padded.view(torch.uint8))  # bytes: exact, and any dtype gloo lacks
    return out.view(shard.dtype).view((c.world_size(), rows) + tuple(shard.shape[1:]))


# ----------------------------------------------------------------- embedding

def _build_embedding(segments: tuple, world: int):
    def build(c, shard):
        if c.world_size() != world:
            raise RuntimeError(f"commfold: replicated embedding compiled for {world} ranks "
                               f"runs on {c.world_size()}")
        if len(segments) > 3 * MAX_SEGMENTS:
            raise ValueError(f"commfold: at most {MAX_SEGMENTS} id ranges per rank")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = shard.shape[0], len(segments) // 3
        header[2: 2 + len(segments)] = torch.tensor(segments, dtype=torch.int64)
        headers = c.all_gather(header.view(1, -1)).view(world, -1).tolist()
        rows = max(h[0] for h in headers)
        shards = _gather_rows(c, shard, max(rows, 1))
        total = max((h[2 + 3 * i + 1] for h in headers for i in range(h[1])), default=0)
        full = shard.new_zeros((total,) + tuple(shard.shape[1:]))
        served = torch.zeros(total, dtype=torch.bool)
        for r, h in enumerate(headers):  # rank order; every rank computes the same
            for i in range(h[1]):
                lo, hi, start = h[2 + 3 * i: 5 + 3 * i]
                if served[lo:hi].any():  # the original would sum two rows: refuse
                    raise RuntimeError("commfold: vocab-parallel embedding shards serve "
                                       "overlapping id ranges; cannot replicate")
                served[lo:hi] = True
                full[lo:hi] = shards[r, start: start + hi - lo]
        return full
    return build


@torch.library.custom_op("commfold::replicated_embedding", mutates_args=(), tags=_TAGS)
def replicated_embedding(ids: torch.Tensor, shard: torch.Tensor, segments: list[int],
                         world_size: int, comm: str) -> torch.Tensor:
    """The sum all-reduce of the vocab-parallel lookup ``ids -> shard`` over all ranks,
    from a cached full weight. `segments` are THIS rank's served id ranges, flat
    (lo, hi, row_start) triples: ids in [lo, hi) read shard row id - lo + row_start."""
    segs = tuple(int(s) for s in segments)
    full = _full_weight("embedding", shard, (segs, world_size), comm,
                        _build_embedding(segs, world_size))
    outside = (ids < 0) | (ids >= full.shape[0])
    rows = F.embedding(ids.masked_fill(outside, 0), full) if full.shape[0] else \
        shard.new_zeros(tuple(ids.shape) + tuple(shard.shape[1:]))
    return rows.masked_fill_(outside.unsqueeze(-1), 0).add_(0.0)


@replicated_embedding.register_fake
def _(ids, shard, segments, world_size, comm):
    return shard.new_empty(tuple(ids.shape) + tuple(shard.shape[1:]))


# ----------------------------------------------------------------- LM head

def _build_lm_head(valid_vocab: int, world: int):
    def build(c, shard):
        if c.world_size() != world:
            raise RuntimeError(f"commfold: replicated LM head compiled for {world} ranks "
                               f"runs on {c.world_size()}")
        full = _gather_rows(c, shard, shard.shape[0])
        full = full.reshape((-1,) + tuple(shard.shape[1:]))
        return full[:valid_vocab].clone() if 0 < valid_vocab < full.shape[0] else full
    return build


@torch.library.custom_op("commfold::replicated_lm_head", mutates_args=(), tags=_TAGS)
def replicated_lm_head(hidden: torch.Tensor, shard: torch.Tensor, valid_vocab: int,
                       world_size: int, comm: str) -> torch.Tensor:
    """``hidden [N, H] @ full.T`` where full is every rank's ``shard [Vs, H]`` stacked in
    rank order, trimmed to `valid_vocab` rows (<= 0: no trim): the gathered logits of a
    vocab-parallel LM head, computed in blocks of Vs columns like each rank did."""
    full = _full_weight("lm_head", shard, (valid_vocab, world_size), comm,
                        _build_lm_head(valid_vocab, world_size))
    vs = shard.shape[0]
    blocks = [torch.mm(hidden, full[i: i + vs].t()) for i in range(0, full.shape[0], vs)]
    return torch.cat(blocks, dim=-1) if len(blocks) != 1 else blocks[0]


@replicated_lm_head.register_fake
def _(hidden, shard, valid_vocab, world_size, comm):
    cols = valid_vocab if valid_vocab > 0 else world_size * shard.shape[0]
    return hidden.new_empty((hidden.shape[0], cols))
