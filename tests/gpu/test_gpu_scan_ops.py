"""commfold's local selection ops on the device, on 2 ranks: local_argmax and
local_topk bit-identical to the full-row rule (torch.argmax's first max, NaN the
maximum; a stable descending sort's first k), softmax_stats' maximum and first max
identical and its sum / logprobs within an ulp of the same op on CPU tensors, and
local_logprobs (vLLM's logprobs) against log_softmax over the whole row. Logit rows
from tests/logit_cases.py: ties, NaN, +-inf, -inf rows, ties across the shard
boundary, signed zeros, bait in the padding column; f32 / bf16 / fp16; and rows of
Qwen's vocab (151936). On CPU (COMMFOLD_GPU_CHECK_DEVICE=cpu) the device calls run
the ops' torch implementation - the code CUDA runs - and the reference calls their
C++ kernels."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_device import DEVICE, rank_device, requires_device, same_bits, shard_of, ulp, world_comm
from logit_cases import DTYPES, make_logits

try:  # the GPU machine may lack hypothesis: the fixed cases run without it
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:
    st = None

pytestmark = requires_device

SPECIALS = ("normal", "ties", "nan", "inf", "neginf_row", "boundary_tie", "signed_zero",
            "padding_bait")
CHAINS = {"none": [], "temperature": [("div", 0.7)]}
KS = (1, 5, 64)


def fixed_cases() -> list[dict]:
    """Every edge kind in every dtype (vocab 301: one padding column on 2 ranks), and
    f32 / bf16 rows of a 151936-token vocab."""
    cases = []
    for i, (dtype, special) in enumerate((d, s) for d in sorted(DTYPES) for s in SPECIALS):
        cases.append({"rows": 5, "vocab": 301, "seed": 11 + i, "special": special,
                      "dtype": dtype, "k": KS[i % 3], "finite_shift": bool(i % 2),
                      "chain": "temperature" if i % 4 == 3 else "none"})
    for dtype in ("f32", "bf16"):
        cases.append({"rows": 4, "vocab": 151936, "seed": 5, "special": "normal",
                      "dtype": dtype, "k": 50, "finite_shift": True, "chain": "none"})
    return cases


def _torch_path(device: torch.device):
    """On CPU, the ops' torch implementation (what runs on CUDA), not their C++ kernels."""
    from contextlib import nullcontext

    from commfold.ops import vocab_scan

    return vocab_scan.fallback() if device.type == "cpu" else nullcontext()


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    a, b = a.cpu().double(), b.cpu().double()
    tol = 2 * ulp(dtype)
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True)


def scan_ops_on_rank(device: str, cases: list[dict]) -> dict:
    """Rank body: each op on the device against its reference; mismatches listed."""
    from commfold.ops import scan_chain
    from commfold.ops.local_argmax import local_argmax
    from commfold.ops.local_topk import local_topk
    from commfold.ops.softmax_stats import softmax_stats

    dev = rank_device(device)
    world, rank, comm = dist.get_world_size(), dist.get_rank(), world_comm()
    bad = []
    for c in cases:
        dtype = DTYPES[c["dtype"]]
        full, vocab = make_logits(dict(c, dtype=dtype), world)
        shard = shard_of(full, world, rank)
        chain = scan_chain.encode(CHAINS[c["chain"]], dtype)
        k = min(c["k"], vocab)
        picks = torch.randint(0, vocab, (c["rows"], 2),
                              generator=torch.Generator().manual_seed(c["seed"]))
        seen = scan_chain.apply(full[:, :vocab], chain) if chain else full[:, :vocab]
        out = scan_chain.out_dtype(chain, dtype)
        want_v, want_i = seen.max(dim=-1)  # CPU: torch.argmax's rule
        order = torch.sort(scan_chain.stored(seen, out) if chain else seen, dim=-1,
                           descending=True, stable=True)
        args = (vocab, comm, c["finite_shift"], True, chain)
        with _torch_path(dev):
            av, ai = local_argmax(shard.to(dev), vocab, comm, False, chain)
            tv, ti = local_topk(shard.to(dev), vocab, comm, k, chain)
            st_dev = softmax_stats(shard.to(dev), picks.to(dev), *args)
        st_cpu = softmax_stats(shard, picks, *args)  # the suite-tested CPU op
        checks = {
            "argmax index": torch.equal(ai.cpu(), want_i),
            "argmax value": same_bits(av, scan_chain.stored(want_v, out) if chain else want_v),
            "topk indices": torch.equal(ti.cpu(), order.indices[:, :k]),
            "topk values": same_bits(tv, order.values[:, :k].to(out)),
            "softmax max": same_bits(st_dev[0], st_cpu[0]),
            "softmax first max": torch.equal(st_dev[2].cpu(), want_i),
            "softmax sum": _close(st_dev[1], st_cpu[1], out),
            "logprobs at picks": _close(st_dev[3], st_cpu[3], out),
        }
        bad += [(name, c) for name, ok in checks.items() if not ok]
    return {"bad": bad, "cases": len(cases)}


def _check(gpu_ranks, record_property, cases, tally=None):
    tally = tally if tally is not None else {"cases": 0, "bad": 0}
    results = gpu_ranks.run(scan_ops_on_rank, DEVICE, cases)
    bad = [b for r in results for b in r["bad"]]
    tally["cases"] += len(cases)
    tally["bad"] += len(bad)
    record_property("numbers", f"{tally['cases']} cases x 3 ops x {len(results)} ranks, "
                               f"{tally['bad']} mismatches")
    assert bad == [], bad[:3]


def test_edge_rows(gpu_ranks, record_property):
    """local_argmax, local_topk, softmax_stats on every edge kind and dtype."""
    _check(gpu_ranks, record_property, fixed_cases())


if st is not None:
    _case = st.fixed_dictionaries({
        "rows": st.integers(1, 6), "vocab": st.integers(2, 3000),
        "seed": st.integers(0, 2**31 - 1), "special": st.sampled_from(SPECIALS),
        "dtype": st.sampled_from(sorted(DTYPES)), "k": st.integers(1, 64),
        "finite_shift": st.booleans(), "chain": st.sampled_from(sorted(CHAINS))})

    @settings(max_examples=4, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases=st.lists(_case, min_size=4, max_size=4))
    def test_drawn_rows(gpu_ranks, record_property, cases):
        """The same ops on rows hypothesis draws (4 examples of 4 cases)."""
        _check(gpu_ranks, record_property, cases, _DRAWN)

    _DRAWN = {"cases": 0, "bad": 0}  # summed over the examples, for the table
else:
    def test_drawn_rows():
        """The same ops on rows hypothesis draws: needs hypothesis."""
        import pytest

        pytest.skip("hypothesis is not installed")
