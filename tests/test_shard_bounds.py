"""commfold.shard.bounds on ranks simulated in one process (harness.fake_comm) against
a full row's exact cut: every rank gets the same bounds, and wherever they are had,
the exact top-k / top-p set (what vLLM's kernel keeps when its search converges) holds
every token above ``keep`` and, of the others, only tokens from ``drop`` up (in
doubt); the one all-gather sends what exchanged_bytes says."""
from __future__ import annotations

import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from commfold.shard import bounds
from harness.fake_comm import ranks


def _exact_edge(row: torch.Tensor, k: int, p: float) -> tuple[float, float | None]:
    """(the smallest value kept, the largest value dropped or None) of the exact cut
    of `row` (float64): top k, then the smallest prefix of mass p over those."""
    v = row.sort(descending=True).values
    kept = min(k, len(v))
    if p < 1.0:
        probs = torch.softmax(v[:kept], dim=0)
        kept = int(torch.nonzero(probs.cumsum(0) >= p)[0]) + 1
    return float(v[kept - 1]), float(v[kept]) if kept < len(v) else None


def _cut_on_ranks(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, world: int):
    vocab = x.shape[1]
    shard = -(-vocab // world)

    def rank(comm):
        start = comm.rank() * shard
        return bounds.cut(comm, x[:, start:start + shard], top_k, top_p, vocab, shard)

    return ranks(world, rank), shard


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), world=st.integers(1, 3), vocab=st.integers(520, 1100),
       scale=st.floats(0.5, 6.0),
       ks=st.lists(st.one_of(st.none(), st.integers(1, 40)), min_size=3, max_size=3),
       ps=st.lists(st.one_of(st.none(), st.floats(0.2, 0.97)), min_size=3, max_size=3))
def test_the_exact_cut_lies_between_the_bounds(seed, world, vocab, scale, ks, ps):
    assume(any(k is not None for k in ks) or any(p is not None for p in ps))  # as called
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, vocab, generator=g) * scale).float()
    top_k = torch.tensor([vocab if k is None else k for k in ks])
    top_p = torch.tensor([1.0 if p is None else p for p in ps], dtype=torch.float32)
    got, shard = _cut_on_ranks(x, top_k, top_p, world)
    first = got[0]
    for other in got[1:]:  # the same answer on every rank
        assert type(other) is type(first)
        if isinstance(first, str):
            assert other == first
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, other))
    assert got.sent == [bounds.exchanged_bytes(3, top_k, top_p, vocab, shard)] * world \
        if bounds.refusal(top_k, vocab, shard) is None else got.sent == [0] * world
    event("refused" if isinstance(first, str) else "bounded")
    if isinstance(first, str):
        return
    for r in range(3):
        k, p = int(top_k[r]), float(top_p[r])
        assert bool(first.rows[r]) == (k < vocab or p < 1.0), r
        if not first.rows[r]:
            continue
        lowest_kept, highest_dropped = _exact_edge(x[r].double(), k, p)
        keep, drop = float(first.keep[r]), float(first.drop[r])
        # kept: above keep, or in doubt (from drop up to keep; drop = inf: none is)
        assert lowest_kept > keep or drop <= lowest_kept, (r, lowest_kept, keep, drop)
        if highest_dropped is not None:
            assert highest_dropped <= keep, (r, highest_dropped, keep)
        # below / between: what a rank may not take for sure, what is in doubt
        below = first.below(x)[r]
        assert torch.equal(below, x[r].double() <= first.keep[r])
        doubt = first.between(x)[r]
        assert torch.equal(doubt > float("-inf"), below & (x[r].double() >= first.drop[r]))


def test_peaked_rows_are_bounded_and_flat_ones_need_more_candidates():
    """A peaked top-p row is bounded from the candidates; a flat one whose mass p
    reaches past them gives the step back with the reason - on every rank."""
    vocab, world = 1000, 2
    g = torch.Generator().manual_seed(3)
    peaked = torch.randn(2, vocab, generator=g) * 6.0
    top_k, top_p = torch.tensor([vocab, 5]), torch.tensor([0.9, 1.0])
    got, _ = _cut_on_ranks(peaked, top_k, top_p, world)
    assert not isinstance(got[0], str) and got[0].rows.tolist() == [True, True]
    flat = torch.randn(2, vocab, generator=g) * 0.01
    got, _ = _cut_on_ranks(flat, torch.tensor([vocab, vocab]), torch.tensor([0.99, 1.0]),
                           world)
    assert got[0] == got[1] and "past the gathered candidates" in got[0]


def test_a_top_k_past_the_limit_is_refused_before_any_exchange():
    vocab, world = 1000, 2
    x = torch.randn(1, vocab)
    got, shard = _cut_on_ranks(x, torch.tensor([shard_k := 400]), torch.tensor([1.0]), world)
    assert got[0] == got[1] == f"top_k={shard_k} (local up to {500 // 4 - 1})"
    assert got.calls == [0, 0]
