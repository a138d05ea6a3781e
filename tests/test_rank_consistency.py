"""Rank consistency: every rank makes the same rewrite decisions (Report.fingerprint()),
also when the ranks differ in timing (one sleeps before compiling) and in free memory
(one holds a large allocation while compiling). One rank rewriting a collective away
and another not would be a collective mismatch: a hang or wrong results.

Each compile uses a config no cached graph has (a nonce): a cache hit would replay a
saved report instead of running the passes under the perturbation."""
from __future__ import annotations

import pickle
import time
import uuid

import torch
import torch.distributed as dist

import commfold
from commfold.cli.demo_model import DecoderConfig, TPDecoder, sample_ids

from harness import fuzz_programs as fp
from harness.draws import drawn

SCENARIOS = ("perturbed",)  # rank 1 sleeps, rank 0 holds memory while compiling
HELD_BYTES = 512 << 20


def _perturb(scenario: str):
    """Apply this rank's perturbation; returns what must stay alive while compiling."""
    rank = dist.get_rank()
    if scenario == "perturbed" and rank == 1:
        time.sleep(2.0)
    if scenario == "perturbed" and rank == 0:
        return torch.ones(HELD_BYTES // 4)  # touched: really resident
    return None


def _fresh_backend(nonce: str):
    """commfold with a config no cached graph was compiled with (an unused `extra`
    entry enters the cache key), so the passes really run under the perturbation.
    Per rank too: ranks share the on-disk cache, and a graph without rank-local
    constants compiled by one rank is a cache hit for a later one.
    (TORCHINDUCTOR_FX_GRAPH_CACHE=1 in the environment overrides a config patch.)"""
    return commfold.backend(extra=(("test_nonce", nonce),))


def _gathered(value) -> list:
    """Every rank's value, pickled into uint8 tensors (torch 2.14's all_gather_object
    needs numpy, which torch does not)."""
    world = dist.get_world_size()
    data = torch.tensor(list(pickle.dumps(value)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()]))
    most = max(int(n) for n in sizes)
    bufs = [torch.zeros(most, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, torch.cat([data, data.new_zeros(most - data.numel())]))
    return [pickle.loads(bytes(b[:int(n)].tolist())) for b, n in zip(bufs, sizes)]


def decoder_fingerprints(nonce: str) -> dict:
    """Per scenario: every rank's fingerprints of compiling TPDecoder (gathered here
    on every rank, so each rank sees all), and the tokens."""
    cfg = DecoderConfig(vocab=300, hidden=32, layers=1, heads=2, ffn=64)
    model = TPDecoder(cfg)
    ids = sample_ids(cfg, batch=2, seq=4)
    out = {}
    for scenario in SCENARIOS:
        torch._dynamo.reset()
        seen = len(commfold.reports())
        held = _perturb(scenario)
        backend = _fresh_backend(f"{nonce}-{dist.get_rank()}-{scenario}")
        tokens = torch.compile(model, backend=backend)(ids)
        del held
        reps = commfold.reports()[seen:]
        mine = {"fingerprints": [r.fingerprint() for r in reps],
                "rewrites": sum(len(r.rewrites) for r in reps),
                "from_cache": any(r.from_cache for r in reps), "tokens": tokens.tolist()}
        out[scenario] = _gathered(mine)
    return out


def test_decoder_decisions_equal_across_ranks(ranks2):
    per_rank = ranks2.run(decoder_fingerprints, uuid.uuid4().hex)
    first = per_rank[0]["perturbed"][0]
    assert first["rewrites"] >= 4 and not first["from_cache"], first  # passes really ran
    for res in per_rank:
        for scenario in SCENARIOS:
            seen = res[scenario]  # what every rank reported, as this rank gathered it
            assert all(s["fingerprints"] == first["fingerprints"] for s in seen), (scenario, seen)
            assert all(s["tokens"] == first["tokens"] for s in seen), (scenario, seen)
            assert not any(s["from_cache"] for s in seen)


def fuzzed_fingerprints(programs, scenario, nonce) -> list:
    held = []
    results = [fp.run_program(p, backend=_fresh_backend(f"{nonce}-{dist.get_rank()}-{i}"),
                              before_compile=lambda: held.append(_perturb(scenario)))
               for i, p in enumerate(programs)]
    held.clear()
    return [dict(r, all_ranks=_gathered(r["fingerprints"])) for r in results]


def test_fuzzed_decisions_equal_across_ranks(ranks2):
    scenario = "perturbed"
    programs = drawn(fp.program(3, 5), 2)  # two distinct programs (harness.draws)
    assert len(programs) == 2
    per_rank = ranks2.run(fuzzed_fingerprints, programs, scenario, uuid.uuid4().hex)
    for i, blocks in enumerate(programs):
        results = [r[i] for r in per_rank]
        assert fp.check(blocks, results) == [], (blocks, scenario)
        for r in results:
            assert not r["from_cache"]
            assert r["all_ranks"] == [results[0]["fingerprints"]] * 2, (blocks, scenario)
