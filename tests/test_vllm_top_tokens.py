"""commfold's local argmax over vLLM's real ParallelLMHead + LogitsProcessor at TP=2.

Inside one vLLM TP=2 group (vLLM CPU's shared-memory communicator, then the
torch.distributed fallback), the compiled ``compute_logits -> argmax`` must pick
exactly the token of vLLM's own ``LogitsProcessor.get_top_tokens`` and of the full
gather + argmax, with a vocab that needs padding, integer logits full of ties across
shards (first max wins), bf16, and a logit scale between the gather and the
argmax; and its graph must hold commfold::local_argmax and no gather of the logits.
A soft-capped head keeps vLLM's own pick (its eager tanh is not compiled code's).
"""
from __future__ import annotations

import pytest
import torch

from harness.vllm_models import (init_vllm_tp, require_vllm_installed, shm_supported,
                                  skip_without_shm)

pytestmark = require_vllm_installed()

H = 64
PAD_VALUE = 3.0  # padding rows: larger logits than any real row for an all-ones hidden


def _build(vocab, dtype, scale=1.0, soft_cap=None, seed=0):
    """vLLM's LM head (weights: small integers, shared by all ranks, padding rows set
    to PAD_VALUE) and logits processor."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    lm = ParallelLMHead(vocab, H, params_dtype=dtype)
    full = torch.randint(-1, 2, (vocab, H), generator=torch.Generator().manual_seed(seed))
    idx = lm.shard_indices
    n = idx.org_vocab_end_index - idx.org_vocab_start_index
    with torch.no_grad():
        lm.weight.fill_(PAD_VALUE)
        lm.weight[:n] = full[idx.org_vocab_start_index:idx.org_vocab_end_index].to(dtype)
    lm.quant_method.process_weights_after_loading(lm)
    return lm, LogitsProcessor(vocab, scale=scale, soft_cap=soft_cap), lm.weight.shape[0] - n


def _hidden(rows, dtype, seed):
    h = torch.randint(-1, 2, (rows, H), generator=torch.Generator().manual_seed(seed))
    h[0] = 1  # all ones: an unmasked padding row would win this row
    return h.to(dtype)


def _compile_and_graph(fn_factory, h):
    """Compile via fn_factory() on its first call with h; return (fn, the local_argmax
    calls and gathers left in the post-grad graph after commfold ran)."""
    from torch._inductor import config as inductor_config

    seen = {}

    def grab(graph):  # runs after commfold's passes (CommfoldPass.then)
        seen["local_argmax"] = [tuple(n.args[1:]) for n in graph.nodes
                                if n.target is torch.ops.commfold.local_argmax.default]
        seen["gathers"] = [str(n.target) for n in graph.nodes if "gather" in str(n.target)
                           or "gather" in str(n.args[0] if n.args else "")]

    fn = fn_factory()
    with inductor_config.patch(post_grad_custom_post_pass=grab, fx_graph_cache=False):
        fn(h)
    return fn, seen


def _check_top_tokens(shm: bool, extras: bool):
    """extras: the soft-cap case and the drafter's get_top_tokens too (in the shm run,
    or in the gloo run where this CPU's vLLM has no shm communicator)."""
    import commfold
    from commfold.vllm.spec_decode.top_tokens import lm_head_top_tokens

    torch._dynamo.reset()  # graphs compiled for the previous group's communicator
    tp = init_vllm_tp(2, shm=shm)
    out = {"rank": tp.rank_in_group, "cases": []}
    cases = [(1000, torch.float32, 1.0, None), (1024, torch.bfloat16, 1.0, None)]
    if extras:
        cases.append((1000, torch.float32, 0.5, None))
    for vocab, dtype, scale, soft_cap in cases:
        lm, lp, n_pad = _build(vocab, dtype, scale, soft_cap)
        commfold.clear_reports()
        ours, seen = _compile_and_graph(lambda: lm_head_top_tokens(lp, lm),  # noqa: B023
                                        _hidden(3, dtype, 1))  # (run in this iteration)
        report = commfold.last_report()
        plain = torch.compile(lambda x: lp(lm, x).argmax(-1),  # noqa: B023 (this iteration)
                              backend="inductor", dynamic=True)
        case = {"vocab": vocab, "dtype": str(dtype), "n_pad": n_pad,
                "padded": lm.num_embeddings_padded != vocab,
                "rewrites": report.count("local_argmax"), "summary": report.summary(),
                "seen": seen, "equal": []}
        for rows in (3, 17, 1):
            h = _hidden(rows, dtype, rows)
            got = ours(h)
            want = {"compiled full gather": plain(h)}
            if soft_cap is None:  # eager logits equal the compiled ones bit for bit
                want["full gather"] = lp(lm, h).argmax(-1)
                want["vLLM get_top_tokens"] = lp.get_top_tokens(lm, h)
            for name, w in want.items():
                case["equal"].append((rows, name, got.dtype == w.dtype and torch.equal(got, w)))
            case.setdefault("tokens", []).append(got.tolist())
        out["cases"].append(case)
    if shm:
        out["bitcast"] = _check_shm_bitcast(tp)
    if extras:
        out["drafter"] = _check_install_get_top_tokens()
        out["soft_capped"] = _check_soft_capped()
    return out


def _check_soft_capped() -> dict:
    """A soft-capped head keeps vLLM's eager pick: no commfold compile, vLLM's tokens."""
    import commfold
    from commfold.vllm.spec_decode.top_tokens import lm_head_top_tokens

    lm, lp, _ = _build(1000, torch.float32, 0.5, 30.0)
    commfold.clear_reports()
    pick = lm_head_top_tokens(lp, lm)
    h = _hidden(5, torch.float32, 4)
    got = pick(h)
    return {"compiled": len(commfold.reports()),
            "equal": torch.equal(got, lp.get_top_tokens(lm, h)) and
            torch.equal(got, lp(lm, h).argmax(-1))}


class _Drafter(torch.nn.Module):
    """A draft model as vLLM writes them, without get_top_tokens."""

    def __init__(self, lm, lp):
        super().__init__()
        self.lm_head, self.logits_processor = lm, lp

    def compute_logits(self, hidden):
        return self.logits_processor(self.lm_head, hidden)


def _check_install_get_top_tokens():
    import commfold
    from commfold.vllm.spec_decode.top_tokens import install_get_top_tokens

    lm, lp, _ = _build(1000, torch.float32, seed=7)
    drafter = _Drafter(lm, lp)
    installed = install_get_top_tokens(drafter)
    commfold.clear_reports()
    h = _hidden(5, torch.float32, 11)
    got = drafter.get_top_tokens(h)
    return {"installed": installed, "again": install_get_top_tokens(drafter),
            "rewrites": commfold.last_report().count("local_argmax"),
            "equal": torch.equal(got, lp.get_top_tokens(lm, h))
            and torch.equal(got, drafter.compute_logits(h).argmax(-1))}


def _check_shm_bitcast(tp):
    """The vllm_shm communicator's gather of int64 pairs (sent bit-cast as float32)
    returns every bit, NaN and infinity patterns included."""
    from commfold.distributed.collectives import communicator

    handle = tp.device_communicator.dist_module.handle
    c = communicator(f"vllm_shm:{handle}")
    specials = torch.tensor([0x7FC00000, 0x7F800001, 0xFF800000, 0x7FFFFFFF], dtype=torch.int64)

    def pairs(rank):
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randint(-2**62, 2**62, (9, 2), generator=g)
        x[:4, 0] = specials | (specials << 32)
        return x

    got = c.all_gather(pairs(c.rank()))
    want = torch.cat([pairs(r) for r in range(c.world_size())])
    return (c.rank(), c.world_size()) == (tp.rank_in_group, 2) and torch.equal(got, want)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_local_argmax_matches_vllm_get_top_tokens(vllm_ranks, shm):
    if shm:
        skip_without_shm()
    extras = shm or not shm_supported()
    results = vllm_ranks.run(_check_top_tokens, shm, extras)
    for res in results:
        for case in res["cases"]:
            where = f"rank {res['rank']}, vocab {case['vocab']}, {case['dtype']}"
            assert case["rewrites"] == 1, (where, case["summary"])
            (args,) = case["seen"]["local_argmax"]
            valid_vocab, comm = args[:2]  # (valid_vocab, comm, keepdim)
            assert comm.startswith("vllm_shm:" if shm else "c10d:"), (where, args)
            # padded: the op masks columns past the vocab; else no mask (or a no-op one)
            allowed = (case["vocab"],) if case["padded"] else (None, 0, case["vocab"])
            assert valid_vocab in allowed, (where, args)
            assert case["seen"]["gathers"] == [], (where, case["seen"])
            bad = [e for e in case["equal"] if not e[2]]
            assert not bad, (where, bad)
            assert len(case["equal"]) >= 3
    # rank 1 holds the padding when vocab=1000 (512 + 488 real rows of 1024)
    assert [c["n_pad"] for c in results[1]["cases"]][:2] == [24, 0]
    # both ranks return the same tokens
    assert [c["tokens"] for c in results[0]["cases"]] == [c["tokens"] for c in results[1]["cases"]]
    if shm:
        assert all(r["bitcast"] for r in results)
    if extras:
        assert all(r["soft_capped"] == {"compiled": 0, "equal": True} for r in results)
        assert all(r["drafter"] == {"installed": True, "again": False, "rewrites": 1,
                                    "equal": True} for r in results), results
