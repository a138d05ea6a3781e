"""commfold's draft-token pick for an EAGLE-3 drafter whose vocab is a subset of the
target's (vLLM's ``draft_id_to_target_id``, d2t), at TP=2 in vLLM's own TP group.

vLLM's ``Eagle3LlamaForCausalLM.compute_logits`` (its real code, on a real
ParallelLMHead + LogitsProcessor) gathers the draft logits and scatters them into a
-inf row of the target vocab; the pick is that row's argmax. commfold's pick
(RemappedPick: a local argmax over the draft vocab, then the remap) must give the
same target ids bit for bit - ties across shards, vocab padding, an all -inf row, an
all-NaN row, bf16 - and run one collective of one (value, index) pair per row per
rank; a remap that is not strictly increasing must fall back to vLLM's pick (same
tokens, the gather kept), and one that leaves the target vocab must raise as vLLM's
pick does.
"""
from __future__ import annotations

import pytest
import torch

from harness.vllm_models import init_vllm_tp, require_vllm_installed

pytestmark = require_vllm_installed()

H, DRAFT, TARGET = 64, 200, 1000


def _drafter(dtype, d2t, special: bool):
    """An object with what vLLM's Eagle3 compute_logits reads, and that method."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    class Drafter(torch.nn.Module):
        compute_logits = Eagle3LlamaForCausalLM.compute_logits

    lm = ParallelLMHead(DRAFT, H, params_dtype=dtype)
    full = torch.randint(-1, 2, (DRAFT, H), generator=torch.Generator().manual_seed(3))
    if special:  # column 0 -inf: h[0] = 1 gives an all -inf row, h[0] = 0 an all-NaN row
        full = full.float()
        full[:, 0] = float("-inf")
    idx = lm.shard_indices
    n = idx.org_vocab_end_index - idx.org_vocab_start_index
    with torch.no_grad():
        lm.weight.fill_(5.0)  # padding rows: would win if unmasked
        lm.weight[:n] = full[idx.org_vocab_start_index:idx.org_vocab_end_index].to(dtype)
    lm.quant_method.process_weights_after_loading(lm)
    d = Drafter()
    d.lm_head, d.logits_processor = lm, LogitsProcessor(DRAFT)
    d.draft_id_to_target_id = torch.nn.Parameter(d2t, requires_grad=False)
    d.config = type("Cfg", (), {"draft_vocab_size": DRAFT, "vocab_size": TARGET})()
    return d


def _hidden(rows, dtype, special):
    h = torch.randint(-1, 2, (rows, H), generator=torch.Generator().manual_seed(rows))
    if special:
        h[:, 0] = torch.arange(rows) % 2  # odd rows all -inf, even rows all NaN
    return h.to(dtype)


def _raises(fn, h):
    try:
        fn(h)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e).__name__
    return None


def _check_picks():
    from commfold import Config
    from commfold.distributed.comm_log import record_collectives
    from commfold.vllm.spec_decode.top_tokens import RemappedPick, draft_top_tokens

    torch._dynamo.reset()
    init_vllm_tp(2, shm=False)  # gloo: the profiler sees every collective
    increasing = torch.arange(DRAFT) * 4 + 7 - torch.arange(DRAFT)  # target ids 7, 11, 15, ...
    bumpy = increasing.clone()
    bumpy[[10, 11]] = bumpy[[11, 10]]  # not monotone: a tie could pick another column
    beyond = increasing + (TARGET - 4 * DRAFT)  # last target id past the vocab
    out = []
    for name, d2t, dtype, special in [
            ("sharded f32", increasing, torch.float32, False),
            ("sharded bf16", increasing, torch.bfloat16, False),
            ("-inf / NaN rows", increasing, torch.float32, True),
            ("not increasing", bumpy, torch.float32, False),
            ("past the vocab", beyond, torch.float32, False)]:
        model = _drafter(dtype, d2t, special)
        pick = draft_top_tokens(model, Config(passes=("local_argmax",)))
        case = {"name": name, "remapped": isinstance(pick, RemappedPick), "equal": [],
                "gathered_elements": []}
        for rows in (5, 16, 1):
            h = _hidden(rows, dtype, special)
            if name == "past the vocab":  # vLLM's own pick indexes past its row
                case["equal"].append(_raises(pick, h) == _raises(model.compute_logits, h))
                continue
            pick(h)  # compile outside the recorded call
            with record_collectives() as comm:
                got = pick(h)
            case["equal"].append(torch.equal(got, model.compute_logits(h).argmax(-1)))
            case["gathered_elements"].append(comm.elements("all_gather"))
            case.setdefault("tokens", []).append(got.tolist())
        out.append(case)
    return out


@pytest.mark.filterwarnings("ignore")
def test_remapped_draft_pick_matches_vllm_eagle3(vllm_ranks):
    results = vllm_ranks.run(_check_picks)
    for rank, cases in enumerate(results):
        by = {c["name"]: c for c in cases}
        for c in cases:
            assert all(c["equal"]), (rank, c)
            assert c["remapped"], (rank, c)
        # sharded head: each rank sends one int64 (value, index) pair per row
        for name in ("sharded f32", "sharded bf16", "-inf / NaN rows"):
            assert by[name]["gathered_elements"] == [r * 2 for r in (5, 16, 1)], by[name]
        # the fallback gathers the logits: each rank sends rows x its shard of the vocab
        assert all(n >= r * DRAFT // 2 for n, r in
                   zip(by["not increasing"]["gathered_elements"], (5, 16, 1)))
        assert by["past the vocab"]["equal"] == [True] * 3  # raises as vLLM's pick does
        # the special rows: all -inf -> target id 0; all NaN -> the first draft id's
        special = by["-inf / NaN rows"]["tokens"][0]
        assert special == [7 if r % 2 == 0 else 0 for r in range(5)], special
    assert [c.get("tokens") for c in results[0]] == [c.get("tokens") for c in results[1]]
