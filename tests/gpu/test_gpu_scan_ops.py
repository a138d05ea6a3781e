"""commfold's local selection ops on the device, on 2 ranks, one rank call per op:
local_argmax and local_topk bit-identical to the full-row rule (torch.argmax's first
max, NaN the maximum; a stable descending sort's first k), softmax_stats' maximum and
first max identical and its sum / logprobs within 2 ulps of the same op on CPU
tensors. Logit rows from harness/logit_cases.py: ties, NaN, +-inf, -inf rows, ties
across the shard boundary, signed zeros, bait in the padding column; f32 / bf16 /
fp16; and rows of Qwen's vocab (151936). On CPU (COMMFOLD_GPU_CHECK_DEVICE=cpu) the
device calls run the ops' torch implementation - the code CUDA runs - and the
reference calls their C++ kernels."""
from __future__ import annotations

from collections import Counter
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from gpu_device import (DEVICE, no_cpp_build_off_cpu, rank_device, requires_device, same_bits,
                        shard_of, ulp, world_comm)
from harness.logit_cases import DTYPES, make_logits

try:  # the GPU machine may lack hypothesis: the fixed cases run without it
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st
except ImportError:
    st = None

pytestmark = requires_device

SPECIALS = ("normal", "ties", "nan", "inf", "neginf_row", "boundary_tie", "signed_zero",
            "padding_bait")
CHAINS = {"none": [], "temperature": [("div", 0.7)]}
KS = (1, 5, 64)
OPS = ("local_argmax", "local_topk", "softmax_stats")


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
    from commfold.ops import vocab_scan

    return vocab_scan.fallback() if device.type == "cpu" else nullcontext()


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    a, b = a.cpu().double(), b.cpu().double()
    tol = 2 * ulp(dtype)
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True)


def _inputs(c: dict, world: int, rank: int) -> dict:
    """A case's logits, this rank's shard and the full-row references (on CPU)."""
    from commfold.ops import chain_encoding

    dtype = DTYPES[c["dtype"]]
    full, vocab = make_logits(dict(c, dtype=dtype), world)
    chain = chain_encoding.encode(CHAINS[c["chain"]], dtype)
    out = chain_encoding.out_dtype(chain, dtype)
    seen = chain_encoding.apply(full[:, :vocab], chain) if chain else full[:, :vocab]
    value, index = seen.max(dim=-1)  # torch.argmax's rule
    return {"shard": shard_of(full, world, rank), "vocab": vocab, "chain": chain, "out": out,
            "k": min(c["k"], vocab), "value": chain_encoding.stored(value, out) if chain else value,
            "index": index, "order": torch.sort(chain_encoding.stored(seen, out) if chain else seen,
                                                dim=-1, descending=True, stable=True),
            "picks": torch.randint(0, vocab, (c["rows"], 2),
                                   generator=torch.Generator().manual_seed(c["seed"]))}


def _checks(op: str, c: dict, x: dict, dev: torch.device, comm: str) -> dict:
    """op on the device shard against the full-row rule (softmax_stats' sum and logprobs:
    against the same op on the CPU shard, the suite-tested kernels)."""
    from commfold.ops.local_argmax import local_argmax
    from commfold.ops.local_topk import local_topk
    from commfold.ops.softmax_stats import softmax_stats

    shard, vocab, chain, out = x["shard"], x["vocab"], x["chain"], x["out"]
    with _torch_path(dev):
        if op == "local_argmax":
            v, i = local_argmax(shard.to(dev), vocab, comm, False, chain)
            return {"index": torch.equal(i.cpu(), x["index"]), "value": same_bits(v, x["value"])}
        if op == "local_topk":
            v, i = local_topk(shard.to(dev), vocab, comm, x["k"], chain)
            return {"indices": torch.equal(i.cpu(), x["order"].indices[:, :x["k"]]),
                    "values": same_bits(v, x["order"].values[:, :x["k"]].to(out))}
        args = (vocab, comm, c["finite_shift"], True, chain)
        got = softmax_stats(shard.to(dev), x["picks"].to(dev), *args)
    with no_cpp_build_off_cpu(dev):  # the CPU reference: C++ in CPU mode, else torch
        want = softmax_stats(shard, x["picks"], *args)
    return {"max": _same_max(got[0], want[0]), "first max": torch.equal(got[2].cpu(), x["index"]),
            "sum": _close(got[1], want[1], out), "logprobs at picks": _close(got[3], want[3], out)}


def _same_max(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal as numbers, NaN to NaN; the sign of a zero maximum is not compared: CUDA's
    and the CPU's max reductions differ in it (measured on an H200, bf16 rows holding
    -0.0 and 0.0), and the maximum only shifts exp(x - max), where both zeros give the
    same sum and logprobs (compared too)."""
    got = got.cpu()
    return same_bits(got, want) or bool(((got == want) | (got.isnan() & want.isnan())).all())


def scan_op_on_rank(device: str, op: str, cases: list[dict]) -> dict:
    """Rank body: one op on every case; mismatches listed."""
    dev = rank_device(device)
    world, rank, comm = dist.get_world_size(), dist.get_rank(), world_comm()
    bad = []
    for c in cases:
        checks = _checks(op, c, _inputs(c, world, rank), dev, comm)
        bad += [(name, c) for name, ok in checks.items() if not ok]
    return {"bad": bad}


def _check(gpu_ranks, record_property, op, cases, tally=None):
    """One rank call per op: an op that fails on the device leaves the others' rows."""
    tally = tally if tally is not None else {"cases": 0, "bad": 0}
    results = gpu_ranks.run(scan_op_on_rank, DEVICE, op, cases)
    bad = [b for r in results for b in r["bad"]]
    tally["cases"] += len(cases)
    tally["bad"] += len(bad)
    record_property("numbers", f"{tally['cases']} cases x {len(results)} ranks, "
                               f"{tally['bad']} mismatches")
    failed = Counter(name for name, _ in bad)
    assert bad == [], f"{dict(failed)}; first in {bad[0][1]}"


@pytest.mark.parametrize("op", OPS)
def test_edge_rows(gpu_ranks, record_property, op):
    """Every edge kind in every dtype, and rows of Qwen's vocab."""
    _check(gpu_ranks, record_property, op, fixed_cases())


if st is not None:
    _case = st.fixed_dictionaries({
        "rows": st.integers(1, 6), "vocab": st.integers(2, 3000),
        "seed": st.integers(0, 2**31 - 1), "special": st.sampled_from(SPECIALS),
        "dtype": st.sampled_from(sorted(DTYPES)), "k": st.integers(1, 64),
        "finite_shift": st.booleans(), "chain": st.sampled_from(sorted(CHAINS))})
    _DRAWN = {op: {"cases": 0, "bad": 0} for op in OPS}  # summed over examples, for the table

    @pytest.mark.parametrize("op", OPS)
    # generate only: a failing example is not shrunk (each try is a rank call, and a
    # failed call restarts the ranks: the check would run out of time)
    @settings(max_examples=3, derandomize=True, deadline=None, database=None,
              phases=[Phase.generate], report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck))
    @given(cases=st.lists(_case, min_size=4, max_size=4))
    def test_drawn_rows(gpu_ranks, record_property, op, cases):
        """Rows hypothesis draws (3 examples of 4 cases)."""
        _check(gpu_ranks, record_property, op, cases, _DRAWN[op])
else:
    @pytest.mark.parametrize("op", OPS)
    def test_drawn_rows(op):
        """Rows hypothesis draws: needs hypothesis."""
        pytest.skip("hypothesis is not installed")
