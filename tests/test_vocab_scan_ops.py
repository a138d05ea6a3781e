"""The local selection ops called directly on 2 gloo ranks, C++ kernels (scan, gather
and combine in C++) against their torch implementation (commfold.ops.vocab_scan's
fallback), and both against the full logits: argmax and top-k bit-identical (values,
indices; NaN counted equal), softmax statistics with M and the first max identical
and S / logprobs within summation-order rounding; padded vocab, elementwise chains
(scale, temperature, offset, casts - exact ops, computed alike by both); the C++
kernels really served the calls."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

from harness.logit_cases import DTYPES, make_logits

CHAINS = {"none": [], "temperature": [("div", 0.7)], "scale+offset": [("mul", 1.3), ("add", 2.0)],
          "to_f32": [("cast", torch.float32), ("mul", 0.5)]}
SPECIALS = ("normal", "ties", "nan", "inf", "neginf_row", "boundary_tie", "signed_zero",
            "padding_bait")


def _bits(t):
    b = t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int64)
    return torch.where(t.isnan(), torch.full_like(b, -1), b)


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _close(a, b) -> bool:
    return a.dtype == b.dtype and torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-7,
                                                 equal_nan=True)


def _both_ways(cases):
    """Rank body: every op on every case, C++ then fallback; mismatches listed."""
    from commfold.ops import chain_encoding as sc, vocab_scan
    from commfold.ops.local_argmax import local_argmax
    from commfold.ops.local_topk import local_topk
    from commfold.ops.softmax_stats import softmax_stats

    world, rank = dist.get_world_size(), dist.get_rank()
    comm = "c10d:" + dist.distributed_c10d._get_default_group().group_name
    mod = vocab_scan.module()
    bad, served = [], 0
    for c in cases:
        dtype = DTYPES[c["dtype"]]
        logits, vocab = make_logits(dict(c, dtype=dtype), world)
        vs = logits.shape[1] // world
        shard = logits[:, rank * vs:(rank + 1) * vs].contiguous()
        chain = sc.encode(CHAINS[c["chain"]], dtype)
        k = min(c["k"], vocab)
        g = torch.Generator().manual_seed(c["seed"])
        picks = torch.randint(0, vocab, (c["rows"], 2), generator=g)

        def run(shard=shard, vocab=vocab, c=c, chain=chain, k=k, picks=picks):
            return (local_argmax(shard, vocab, comm, c["keepdim"], chain),
                    local_topk(shard, vocab, comm, k, chain),
                    softmax_stats(shard, picks, vocab, comm, c["finite_shift"], True, chain))

        before = mod.calls()
        fast = run()
        served += mod.calls() - before
        with vocab_scan.fallback():
            slow = run()
        (av, ai), (tv, ti), st_fast = fast
        (av2, ai2), (tv2, ti2), st_slow = slow
        # against the full logits (the chain's exact ops in f32, as the kernels do)
        full = logits[:, :vocab]
        seen = sc.apply(full, chain) if chain else full.float()
        want_i = seen.max(dim=-1).indices
        order = torch.sort(sc.stored(seen, sc.out_dtype(chain, dtype)).float() if chain else seen,
                           dim=-1, descending=True, stable=True).indices[:, :k]
        checks = {
            "argmax C++ == fallback": _same(av, av2) and torch.equal(ai, ai2),
            "argmax == full row": torch.equal(ai.reshape(-1), want_i),
            "topk C++ == fallback": _same(tv, tv2) and torch.equal(ti, ti2),
            "topk == stable sort": torch.equal(ti, order),
            "softmax M, first identical": _same(st_fast[0], st_slow[0])
            and torch.equal(st_fast[2], st_slow[2]) and torch.equal(st_fast[2], want_i),
            "softmax S, logprobs close": _close(st_fast[1], st_slow[1])
            and _close(st_fast[3], st_slow[3]),
        }
        bad += [(name, {k: v for k, v in c.items()}) for name, ok in checks.items() if not ok]
    return {"bad": bad, "served": served, "cases": len(cases)}


def _float64_goes_to_torch():
    from commfold.ops import vocab_scan
    from commfold.ops.local_argmax import local_argmax

    rank = dist.get_rank()
    comm = "c10d:" + dist.distributed_c10d._get_default_group().group_name
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * rank
    before = vocab_scan.module().calls()
    value, index = local_argmax(x, None, comm)
    return vocab_scan.module().calls() - before, index.tolist(), value.tolist()


case = st.fixed_dictionaries({
    "rows": st.integers(1, 6), "vocab": st.integers(2, 500), "seed": st.integers(0, 2**31 - 1),
    "special": st.sampled_from(SPECIALS), "dtype": st.sampled_from(sorted(DTYPES)),
    "chain": st.sampled_from(sorted(CHAINS)), "k": st.integers(1, 64),
    "keepdim": st.booleans(), "finite_shift": st.booleans()})


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(case, min_size=6, max_size=6))
def test_cpp_kernels_equal_torch_implementation(ranks2, cases):
    for res in ranks2.run(_both_ways, cases):
        assert res["bad"] == [], res["bad"][:3]
        assert res["served"] == 3 * res["cases"]  # every call ran in C++


def test_float64_takes_the_torch_path(ranks2):
    res = ranks2.run(_float64_goes_to_torch)
    assert all(r[0] == 0 for r in res)  # not served in C++
    assert res[0][1:] == res[1][1:] == ([5, 5], [12.0, 15.0])  # rows 0..2|10..12, 3..5|13..15
    assert not math.isnan(res[0][2][0])
