"""The C++ scans of the local selection ops against their torch definitions, in one
process (no ranks): argmax (first max, NaN the maximum, first NaN wins), top-k
(stable descending sort's order, NaN largest, -0.0 == +0.0, bits kept) and the
softmax statistics (max, float64 sum of exp, first max), in f32/bf16/fp16, rows of
odd lengths (vector tails), NaN / +-inf / -0.0, ties across vector lanes and across
the column runs a row is split into for threads, all -inf rows, ascending rows (every
logit beats the running k-th), k up to 64, 1-3 threads, with and without an
elementwise chain (scale, temperature, offset, tanh soft-cap, casts)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from commfold.ops import chain_encoding as sc
from commfold.ops import vocab_scan
from harness.logit_cases import DTYPES, with_special

mod = vocab_scan.module()
pytestmark = pytest.mark.skipif(mod is None, reason="no C++ toolchain here (the torch "
                                                     "implementation serves every call)")

KINDS = ("normal", "ties", "nan", "inf", "neginf_rows", "signed_zero", "ascending",
         "lane_ties")
CHAINS = {
    "none": [],
    "scale": [("mul", 0.7)],
    "temperature+offset": [("div", 0.7), ("add", 1.5), ("sub", 0.25)],
    "to_f32": [("cast", torch.float32), ("mul", 1.3)],
    "soft_cap": [("div", 30.0), ("tanh", None), ("mul", 30.0)],
}
_INT = {2: torch.int16, 4: torch.int32}


def make_rows(rows, n, pad, dtype, kind, seed):
    """[rows, n + pad] logits; the pad columns hold NaN / +inf bait (never read)."""
    g = torch.Generator().manual_seed(seed)
    x = with_special(torch.randn(rows, n + pad, generator=g, dtype=torch.float64) * 4,
                     kind, g)
    if kind == "neginf_rows":
        x[::2] = -math.inf
    elif kind == "ascending":
        x = x.sort(dim=-1).values
    elif kind == "lane_ties":  # the maximum at positions one lane, 16 lanes, a run apart
        x = x.clamp(-50, 50)
        for p in {0, 1, 15, 16, 17, n // 3, n // 2, n - 2, n - 1}:
            if 0 <= p < n:
                x[:, p] = 99.0
    x = x.to(dtype)
    x[:, n:] = math.nan if seed % 2 else math.inf
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, every NaN one pattern (chain outputs canonicalize NaN)."""
    b = t.contiguous().view(_INT[t.element_size()]).to(torch.int64)
    return torch.where(t.isnan(), torch.full_like(b, -1), b)


def chain_of(name, dtype):
    chain = sc.encode(CHAINS[name], dtype)
    return None if chain is None else chain


def compared(x, chain, rounded):
    """Reference values a scan compares: the torch chain for exact ops; the kernel's
    own chain values where tanh is involved (checked against Inductor separately)."""
    if not chain:
        return x.float()
    if sc.TANH in chain[::2]:
        return mod.chain_values(x.contiguous(), chain, rounded)
    v = sc.apply(x, chain)
    return sc.stored(v, sc.out_dtype(chain, x.dtype)).float() if rounded else v


@pytest.fixture
def threads():
    """Run with t threads and runs of >= 8 columns (rows split across threads)."""
    old = torch.get_num_threads()

    def use(t):
        torch.set_num_threads(t)
        mod.set_min_run(8)

    yield use
    torch.set_num_threads(old)
    mod.set_min_run(1 << 15)


case = st.fixed_dictionaries({
    "rows": st.integers(1, 5), "n": st.integers(1, 300), "pad": st.integers(0, 5),
    "dtype": st.sampled_from(sorted(DTYPES)), "kind": st.sampled_from(KINDS),
    "chain": st.sampled_from(sorted(CHAINS)), "threads": st.integers(1, 3),
    "seed": st.integers(0, 2**31 - 1)})
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=list(HealthCheck))


def _setup(c, threads):
    threads(c["threads"])
    dtype = DTYPES[c["dtype"]]
    x = make_rows(c["rows"], c["n"], c["pad"], dtype, c["kind"], c["seed"])
    return x, c["n"], chain_of(c["chain"], dtype), dtype


@SETTINGS
@given(c=case)
def test_argmax_scan(threads, c):
    x, n, chain, dtype = _setup(c, threads)
    value, index = mod.argmax_rows(x, n, chain)
    seen = compared(x[:, :n], chain, rounded=False)
    want = seen.max(dim=-1).indices  # torch's first max, first NaN
    assert torch.equal(index, want), (index, want)
    if chain:
        out = sc.out_dtype(chain, dtype)
        want_value = sc.stored(seen.gather(-1, want[:, None]).squeeze(-1), out)
    else:  # the column's own bits (-0.0 and NaN payloads kept)
        want_value = x.gather(-1, want[:, None]).squeeze(-1)
    assert value.dtype == want_value.dtype
    assert torch.equal(bits(value), bits(want_value))


@SETTINGS
@given(c=case, k=st.integers(1, 64))
def test_topk_scan(threads, c, k):
    x, n, chain, dtype = _setup(c, threads)
    k = min(k, n)
    value, index = mod.topk_rows(x, n, k, chain)
    seen = compared(x[:, :n], chain, rounded=True)
    order = torch.sort(seen, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(index, order), (index, order)
    stored = sc.stored(seen, sc.out_dtype(chain, dtype)) if chain else x[:, :n]
    assert torch.equal(bits(value), bits(stored.gather(-1, order)))


@SETTINGS
@given(c=case)
def test_softmax_scan(threads, c):
    x, n, chain, dtype = _setup(c, threads)
    m, s, first = mod.softmax_rows(x, n, chain)
    seen = compared(x[:, :n], chain, rounded=False)
    top, want_first = seen.max(dim=-1)
    assert torch.equal(first, want_first)
    assert bool(((m == top) | (m.isnan() & top.isnan())).all())
    shift = torch.where(top.isfinite(), top, torch.zeros_like(top))
    want_s = (seen - shift[:, None]).exp().sum(dim=-1, dtype=torch.float64)
    assert torch.equal(s.isnan(), want_s.isnan()) and torch.equal(s.isinf(), want_s.isinf())
    assert torch.equal(s == 0, want_s == 0)
    assert torch.allclose(s, want_s, rtol=1e-6, atol=0, equal_nan=True), (s, want_s)


def test_chain_values_are_inductors():
    """The kernels evaluate a chain as Inductor's CPU code does, bit for bit (tanh:
    ATen's vectorized Sleef tanh), and round it as the graph stores it."""
    x = torch.cat([torch.randn(4000) * 40, torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, 1e-30, -1e30, 3.0e38])])
    softcap = lambda t: torch.tanh(t / 30.0) * 30.0 * 0.7  # noqa: E731
    chain = sc.encode([("div", 30.0), ("tanh", None), ("mul", 30.0), ("mul", 0.7)],
                      torch.float32)
    compiled = torch.compile(softcap, backend="inductor")
    assert torch.equal(bits(mod.chain_values(x, chain, True)), bits(compiled(x)))
    # a bf16 graph computes the chain in f32 from the bf16 values and stores it rounded
    # to nearest even (as .to() does): one compile, reused for the bf16 values
    xb = x.bfloat16()
    want_bf16 = compiled(xb.float())
    got = mod.chain_values(xb, chain, True)
    assert torch.equal(bits(got.bfloat16()), bits(want_bf16.bfloat16()))
    assert torch.equal(bits(got), bits(got.bfloat16().float()))


def test_chain_encoding():
    assert sc.encode([], torch.float32) is None
    assert sc.encode([("cast", torch.float64)], torch.float32) is None  # no f64 kernels
    assert sc.encode([("cast", torch.bfloat16)], torch.float32) is None  # narrowing
    assert sc.encode([("cast", torch.float16)], torch.bfloat16) is None  # changes values
    assert sc.encode([("mul", math.inf)], torch.float32) is None
    assert sc.encode([("exp", None)], torch.float32) is None
    chain = sc.encode([("cast", torch.float32), ("mul", 2)], torch.bfloat16)
    assert chain == [sc.CAST, float(sc.F32), sc.MUL, 2.0]
    assert sc.out_dtype(chain, torch.bfloat16) == torch.float32
    assert sc.out_dtype(None, torch.float16) == torch.float16


def test_large_rows_split_across_threads(threads):
    """Long rows, few of them: each row is split into column runs on several threads;
    the first max / the top k / the statistics are the whole row's."""
    threads(3)
    mod.set_min_run(1000)
    x = torch.randn(2, 50_001)
    x[:, [7, 20_000, 49_999]] = 9.0  # ties in different runs: the first wins
    value, index = mod.argmax_rows(x, 50_001, None)
    assert index.tolist() == [7, 7]
    v, i = mod.topk_rows(x, 50_001, 5, None)
    assert i[:, :3].tolist() == [[7, 20_000, 49_999]] * 2
    assert torch.equal(i, torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :5])
    m, s, first = mod.softmax_rows(x, 50_001, None)
    want = (x.double() - 9.0).exp().sum(-1)
    assert first.tolist() == [7, 7] and torch.allclose(s, want, rtol=1e-6)
