"""The GPU estimate (benchmarks/gpu_estimate.py): its published figures read back as
the model says (the table's times up to 128 KiB per rank, bandwidth past it), and
commfold.cost's CUDA entries are the numbers it derives, so a change to either shows."""
from __future__ import annotations

import torch

from benchmarks import gpu_estimate as g
from commfold import cost


def test_collective_model_reads_the_published_table():
    assert g.all_gather_us(16, 2) == g.AG["eager"][0]  # below the table: its 2 KiB time
    assert g.all_gather_us(65536, 8) == 15.94 and g.all_to_all_us(131072, 8) == 21.18
    assert g.AG["eager"][3] < g.all_gather_us(20000, 8) < g.AG["eager"][4]
    # past 128 KiB: (N - 1) x the extra bytes at 370 GB/s
    extra = 370_000  # one microsecond's bytes
    assert abs(g.all_gather_us(131072 + extra, 2) - (18.14 + 1)) < 1e-9
    assert abs(g.all_gather_us(131072 + extra, 8) - (18.14 + 7)) < 1e-9
    assert abs(g.all_to_all_us(131072 + 2 * extra, 2) - (21.18 + 1)) < 1e-9


def test_cost_rule_cuda_entries_are_the_estimates():
    bf16 = torch.bfloat16
    logprobs = cost.limit_for(cost.pick_site(cost.LOCAL_LOGPROBS, "cuda", cost.VLLM, bf16,
                                             1, 151936, 2))
    dspark = cost.limit_for(cost.dspark_site("cuda", cost.VLLM, bf16, 1, 2, 151936, 2))
    assert logprobs.least == g.logprobs_least(2)
    sampled = cost.limit_for(cost.pick_site(cost.SAMPLED_PICK, "cuda", cost.VLLM, bf16,
                                            1, 151936, 2))
    assert sampled.least == g.sampled_least(2)
    assert abs(g.all_gather_us(g.sampled_least(2), 2) - 3 * g.AG["eager"][0]) < 1e-3
    assert dspark.least == g.per_exchange_least(2)
    # at the derived size the gather costs what the two exchanges do
    assert abs(g.all_gather_us(g.logprobs_least(2), 2) - 2 * g.AG["eager"][0]) < 1e-3
    # the greedy pick: one exchange is never dearer than the gather it replaces
    assert cost.limit_for(cost.pick_site(cost.LOCAL_PICK, "cuda", cost.VLLM, bf16, 1,
                                         151936, 2)) is None
    for part in (2048, 65536, 151936, 10 ** 7):
        assert g.all_gather_us(16, 2) <= g.all_gather_us(part, 2) + 0.6
