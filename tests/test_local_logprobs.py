"""commfold.ops.local_logprobs on 2 gloo ranks against vLLM's rule (torch.topk of
(x - M) - L, the token's logprob, rank = how many logprobs are >= it) computed on the
whole row - under every L a CPU may compute, not only this one's.

vLLM's L (log of a float32 sum over the row) rounds differently per CPU (torch's
vector width), and where logits are a few ulps of the logprob apart that decides
which logprobs tie: the top-k ids and ranks then depend on L. Rows commfold does
locally must give vLLM's ids and ranks for L within +-4 ulps of this CPU's (the ids
and ranks no L can change); the others must go to vLLM's own code (the fallback),
whole. Near-uniform logits (what vLLM's dummy weights give) are such rows; logits
spread like a real model's never are.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

PAD = 1e4  # padding columns of the last shard: never part of the row


def _rule(full: torch.Tensor, tokens: torch.Tensor, k: int, log_s: torch.Tensor):
    """vLLM's ids [R, k + 1] and ranks [R] with log-sum-exp log_s (float32 [R])."""
    big_m = full.max(-1).values
    lp = (full - big_m[:, None]) - log_s[:, None]
    lp_t = lp.gather(1, tokens[:, None])
    ids = torch.cat([tokens[:, None], torch.topk(lp, k).indices], 1)
    return ids, (lp >= lp_t).sum(-1)


def _this_cpus_l(full: torch.Tensor) -> torch.Tensor:
    """torch's own L: minus the logprob of the row's maximum."""
    lp = torch.log_softmax(full, -1)
    return -lp.gather(1, full.argmax(-1, keepdim=True))[:, 0]


def _step(log_s: torch.Tensor, ulps: int) -> torch.Tensor:
    toward = torch.tensor(math.inf if ulps > 0 else -math.inf)
    for _ in range(abs(ulps)):
        log_s = torch.nextafter(log_s, toward)
    return log_s


def logits(rows: int, vocab: int, dtype: str, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "dummy":  # vLLM's dummy weights: logits of ~1e-5, nearly uniform
        x = (torch.rand(rows, vocab, generator=g) - 0.5) * 2e-5
    elif kind == "ties":
        x = torch.randint(-3, 4, (rows, vocab), generator=g).float()
    else:  # a real model's spread
        x = torch.randn(rows, vocab, generator=g) * 3
    return x.to(getattr(torch, dtype)).float()


def _sharded(rows, vocab, dtype, kind, seed, scored):
    """(the full logits, this rank's padded shard in dtype, targets or None)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full = logits(rows, vocab, dtype, kind, seed)
    vs = math.ceil(vocab / world)
    padded = torch.nn.functional.pad(full, (0, world * vs - vocab), value=PAD)
    shard = padded[:, rank * vs:(rank + 1) * vs].to(getattr(torch, dtype)).contiguous()
    g = torch.Generator().manual_seed(seed + 1)
    return full, shard, torch.randint(0, vocab, (rows,), generator=g) if scored else None


def local_vs_rule(rows, vocab, dtype, kind, k, scored, seed):
    from commfold.ops.local_logprobs import local_logprobs

    full, shard, targets = _sharded(rows, vocab, dtype, kind, seed, scored)
    whole = torch.zeros(rows, dtype=torch.bool)

    def fallback(f, tokens, kk):  # vLLM's code on whole rows: the rule with torch's L
        f = f.float()  # vLLM's logprobs are of float32 logits
        for row in f:
            whole[(full == row).all(-1)] = True
        ids, ranks = _rule(f, tokens, kk, _this_cpus_l(f))
        return ids, torch.zeros(ids.shape), ranks

    comm = f"c10d:{dist.group.WORLD.group_name}"
    tokens, ids, _, ranks = local_logprobs(shard, vocab, comm, k, fallback, targets)
    own = full.argmax(-1) if targets is None else targets
    l_here = _this_cpus_l(full)
    ids0, ranks0 = _rule(full, own, k, l_here)
    # per row: equal to the rule under every L within 4 ulps of this CPU's (ids and
    # ranks), and whether some of those L disagree with this CPU's
    same_all = torch.ones(rows, dtype=torch.bool)
    l_decides = torch.zeros(rows, dtype=torch.bool)
    for u in range(-4, 5):
        want_ids, want_ranks = _rule(full, own, k, _step(l_here, u))
        same_all &= (ids == want_ids).all(-1) & (ranks == want_ranks)
        l_decides |= (want_ids != ids0).any(-1) | (want_ranks != ranks0)
    here = (ids == ids0).all(-1) & (ranks == ranks0)
    return {"tokens": torch.equal(tokens, own), "whole": whole.tolist(),
            "local_rows_hold": bool(same_all[~whole].all()), "whole_rows_are_vllms":
            bool(here[whole].all()), "l_decides": l_decides.tolist()}


@settings(max_examples=24, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 6), vocab=st.integers(1280, 3000),
       dtype=st.sampled_from(["float32", "bfloat16"]),
       kind=st.sampled_from(["dummy", "ties", "spread"]), k=st.sampled_from([0, 1, 5, 20]),
       scored=st.booleans(), seed=st.integers(0, 2**16))
def test_ids_and_ranks_hold_under_any_cpus_l(ranks2, rows, vocab, dtype, kind, k, scored, seed):
    for res in ranks2.run(local_vs_rule, rows, vocab, dtype, kind, k, scored, seed):
        assert res["tokens"] and res["local_rows_hold"] and res["whole_rows_are_vllms"], res
        # where L decides a row's answer, that row went whole
        assert all(w for w, d in zip(res["whole"], res["l_decides"]) if d), res
        if kind == "spread":  # a real model's logits: never sent whole
            assert not any(res["whole"]), res


def test_dummy_logits_are_rows_l_decides(ranks2):
    """The hazard is real: for dummy-weight logits, other CPUs' L give other ids or
    ranks than this CPU's in some rows, and those rows go whole."""
    for res in ranks2.run(local_vs_rule, 6, 2000, "bfloat16", "dummy", 5, True, 7):
        assert any(res["l_decides"]) and res["whole_rows_are_vllms"], res
        assert all(w for w, d in zip(res["whole"], res["l_decides"]) if d), res


# --- Model Runner V2's rule: torch.topk of the logits, rank over the logits ---------

def topk_scores_vs_v2_rule(rows, vocab, dtype, kind, k, exact_ties, logits_mode, seed,
                           scored=False):
    """local_topk_scores against V2's compute_topk_scores rule on the whole row (in
    torch): ids [the token (argmax, or a target: prompt logprobs), topk(logits, k)],
    ranks (x >= x_token).sum(), scores the logits or (x - M) - L with an exact L."""
    from commfold.ops.local_logprobs import local_topk_scores

    full, shard, targets = _sharded(rows, vocab, dtype, kind, seed, scored)
    got = local_topk_scores(shard, vocab, f"c10d:{dist.group.WORLD.group_name}", k,
                            logits_mode, exact_ties, targets)
    tokens = full.argmax(-1) if targets is None else targets
    ids = torch.cat([tokens[:, None], torch.topk(full, k).indices], 1)
    ranks = (full >= full.gather(1, tokens[:, None])).sum(-1)
    x = full.gather(1, ids).double()
    exact_l = torch.logsumexp(full.double(), -1)[:, None]
    want = x if logits_mode else x - exact_l
    top = torch.topk(full, k + 1).values
    tied = (top[:, 1:] == top[:, :-1]).any(-1)
    ok = ~got.whole
    return {"tokens": torch.equal(got.tokens, tokens),
            "ids": bool((got.ids == ids).all(-1)[ok].all()),
            "ranks": bool((got.ranks == ranks)[ok].all()),
            "scores": float((got.scores.double() - want).abs().max()),
            "whole": got.whole.tolist(), "tied": tied.tolist()}


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(rows=4, vocab=2001, dtype="bfloat16", kind="ties", k=5, exact_ties=False,
         logits_mode=False, seed=3, scored=False)
@example(rows=4, vocab=2001, dtype="float32", kind="ties", k=20, exact_ties=True,
         logits_mode=True, seed=4, scored=True)
@given(rows=st.integers(1, 6), vocab=st.integers(1400, 3000),
       dtype=st.sampled_from(["float32", "bfloat16"]), kind=st.sampled_from(["ties", "spread"]),
       k=st.sampled_from([0, 1, 5, 20]), exact_ties=st.booleans(), logits_mode=st.booleans(),
       seed=st.integers(0, 2**16), scored=st.booleans())
def test_v2_topk_scores_equal_the_whole_rows(ranks2, rows, vocab, dtype, kind, k, exact_ties,
                                             logits_mode, seed, scored):
    """Ids (their order among equal logits included) and ranks exact, scores the logits
    or within float32 rounding of the exact logprob, for the greedy token and for
    targets (prompt logprobs). Without exact ties (another device's torch.topk),
    exactly the rows whose top k + 1 hold equal logits go whole."""
    for res in ranks2.run(topk_scores_vs_v2_rule, rows, vocab, dtype, kind, k, exact_ties,
                          logits_mode, seed, scored):
        assert res["tokens"] and res["ids"] and res["ranks"], res
        assert res["scores"] <= (0 if logits_mode else 1e-5), res
        assert res["whole"] == ([False] * rows if exact_ties else res["tied"]), res
        if kind == "ties" and not exact_ties and k:
            assert any(res["whole"]), res  # the tie rule really ran
