"""Each commfold pass on programs Inductor compiles for the device, on 2 ranks
sharing it (gloo): the tokens and values of the rewritten program equal plain
Inductor's, and the pass rewrote something (a pass that silently does nothing on the
device's graphs fails here). One compile per program and backend:

- commfold.cli.demo_model.TPDecoder (1 layer, vocab 1001 padded to 1002): greedy tokens of
  4 sequences x 4 steps, with fuse_allreduce_rmsnorm + local_argmax, and with
  replicate_vocab_parallel (it takes the LM head's gather away, so alone);
- a vocab program (two shards, 8 rows, vocab 4001): top-8 of f32 logits / 0.7, and
  log_softmax at chosen tokens, greedy picks and logsumexp of bf16 logits, with
  local_topk + local_softmax_stats.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from commfold.cli.demo_model import gather_last_dim
from gpu_device import DEVICE, rank_device, requires_device, shard_of

pytestmark = requires_device

DECODER_PASSES = {"fused": ("fuse_allreduce_rmsnorm", "local_argmax"),
                  "replicated": ("replicate_vocab_parallel",)}
VOCAB_PASSES = ("local_softmax_stats", "local_topk")
STEPS, VOCAB, ROWS, K = 4, 4001, 8, 8


def _rewrites(passes) -> dict:
    """Per pass: rewrites, errors and bytes per call before -> after, from the reports
    of the compiles since commfold.clear_reports()."""
    import commfold
    from commfold.report import format_bytes

    out = {}
    for p in passes:
        done = [w for r in commfold.reports() for w in r.rewrites if w.pass_name == p]
        out[p] = {"count": len(done), "graphs": len(commfold.reports()),
                  "sites": sorted(w.pattern for w in done),
                  "near": sorted({m.reason for r in commfold.reports() for m in r.near_misses
                                  if m.pass_name == p}),
                  "errors": [e.error for r in commfold.reports() for e in r.errors
                             if e.pass_name == p],
                  "comm": f"{format_bytes(sum(w.comm_before.bytes for w in done))} -> "
                          f"{format_bytes(sum(w.comm_after.bytes for w in done))}"}
    return out


def decoder_on_rank(device: str) -> dict:
    import commfold
    from commfold.cli.demo_model import DecoderConfig, TPDecoder, greedy_decode, sample_ids

    dev = rank_device(device)
    cfg = DecoderConfig(vocab=1001, hidden=256, layers=1, heads=4, ffn=512)
    model = TPDecoder(cfg).to(dev)
    ids = sample_ids(cfg, 4, 16).to(dev)
    out = {}
    with torch.no_grad():
        base = greedy_decode(torch.compile(model, backend="inductor"), ids, STEPS).cpu()
        for name, passes in DECODER_PASSES.items():
            commfold.clear_reports()
            # the cost rule off: without FlashInfer it leaves CUDA norm sites unfused,
            # and this checks the fused op compiled for CUDA
            prog = torch.compile(model, backend=commfold.backend(passes=passes,
                                                                 fuse_cost_rule=False))
            t = time.perf_counter()
            tokens = greedy_decode(prog, ids, STEPS).cpu()
            out[name] = {"same_tokens": torch.equal(tokens, base), "tokens": tokens.numel(),
                         "compile_s": time.perf_counter() - t, **_rewrites(passes)}
    return out


def vocab_program(top_shard, stats_shard, picks):
    """top-k of scaled f32 logits; logprobs at picks, greedy picks and logsumexp of bf16
    logits (each a gather of vocab-sharded logits as TPDecoder spells it on this torch,
    padding sliced off)."""
    top = gather_last_dim(top_shard, dist.group.WORLD)[:, :VOCAB]
    values, indices = torch.topk(top / 0.7, K, dim=-1)
    x = gather_last_dim(stats_shard, dist.group.WORLD)[:, :VOCAB]
    lp = torch.log_softmax(x.float(), -1)
    return values, indices, lp.gather(-1, picks), x.argmax(-1), torch.logsumexp(x.float(), -1)


def vocab_on_rank(device: str) -> dict:
    import commfold

    dev = rank_device(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    padded = world * -(-VOCAB // world)
    full = torch.randn(2, ROWS, padded, generator=g) * 4
    full[:, :, VOCAB:] = float("nan")  # bait: a reader of the padding is wrong
    args = (shard_of(full[0], world, rank).to(dev),
            shard_of(full[1].bfloat16(), world, rank).to(dev),
            torch.randint(0, VOCAB, (ROWS, 3), generator=g).to(dev))
    with torch.no_grad():
        want = torch.compile(vocab_program, backend="inductor")(*args)
        commfold.clear_reports()
        got = torch.compile(vocab_program, backend=commfold.backend(passes=VOCAB_PASSES))(*args)
    same = {"topk": torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]),
            "argmax": torch.equal(got[3], want[3]),
            "logprobs": torch.allclose(got[2], want[2], rtol=1e-5, atol=1e-5),
            "logsumexp": torch.allclose(got[4], want[4], rtol=1e-5, atol=1e-5)}
    diff = max((got[i].double() - want[i].double()).abs().max().item() for i in (2, 4))
    return {"same": same, "max_diff": diff, **_rewrites(VOCAB_PASSES)}


@pytest.fixture(scope="module")
def decoder(gpu_ranks):
    return gpu_ranks.run(decoder_on_rank, DEVICE)


@pytest.fixture(scope="module")
def vocab(gpu_ranks):
    return gpu_ranks.run(vocab_on_rank, DEVICE)


def _check_rewrites(per_rank: list[dict], record_property, name: str, extra: str) -> None:
    """The pass rewrote something, without errors, as often on every rank."""
    r0 = per_rank[0][name]
    near = f"; near-misses: {'; '.join(r0['near'])}" if r0["near"] else ""
    record_property("numbers", f"{r0['count']} rewrites in {r0['graphs']} graph(s): "
                               f"{', '.join(r0['sites'])} (comm/call {r0['comm']}){extra}{near}")
    for r in per_rank:
        assert r[name]["errors"] == [], r[name]["errors"]
        assert r[name]["count"] > 0, f"{name} rewrote nothing; near-misses: {r[name]['near']}"
        assert r[name]["count"] == r0["count"]  # rank-consistent


@pytest.mark.parametrize("name", [p for passes in DECODER_PASSES.values() for p in passes])
def test_decoder(decoder, record_property, name):
    key = next(k for k, passes in DECODER_PASSES.items() if name in passes)
    runs = [r[key] for r in decoder]
    _check_rewrites(runs, record_property, name, f"; {runs[0]['tokens']} tokens, compile + "
                                                 f"decode {runs[0]['compile_s']:.0f} s")
    assert all(r["same_tokens"] for r in runs), "tokens differ from Inductor's"


@pytest.mark.parametrize("name", VOCAB_PASSES)
def test_vocab_program(vocab, record_property, name):
    _check_rewrites(vocab, record_property, name, f"; logprob max diff {vocab[0]['max_diff']:.1e}")
    for r in vocab:
        assert all(r["same"].values()), r["same"]
