"""DSpark's Markov head (vLLM's Qwen3DSparkForCausalLM.markov_embed / markov_bias, run
eagerly once per draft position by Model Runner V2's DSpark speculator) in a vLLM TP=2
group: as vLLM ships it (replicated by hand) commfold leaves it alone; built sharded,
as before vLLM's hand edit, commfold.vllm.eager_heads compiles its calls with the
replicate pass: the embedding's per-position all-reduce is gone and the values are
bit-identical to the unrewritten sharded head's; the head's matmul on vLLM CPU runs on
a oneDNN-packed weight, so its gather stays, with the near-miss that says why."""
from __future__ import annotations

from harness.vllm_models import init_vllm_tp, require_vllm_installed, shm_supported

pytestmark = require_vllm_installed()

V, R = 1000, 16


def _heads(shm: bool) -> dict:
    import torch
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)
    from vllm.model_executor.models.qwen3_dspark import (DSparkMarkovHead,
                                                         Qwen3DSparkForCausalLM)

    from commfold.config import Config
    from commfold.distributed.comm_log import record_collectives
    from commfold.report import clear_reports, reports
    from commfold.vllm.eager_heads import hook_markov_head

    class Drafter(torch.nn.Module):  # what the speculator calls, vLLM's own methods
        markov_embed = Qwen3DSparkForCausalLM.markov_embed
        markov_bias = Qwen3DSparkForCausalLM.markov_bias

    def drafter(sharded: bool):
        head = DSparkMarkovHead(V, V, R, prefix="markov_head")  # replicated, as shipped
        if sharded:  # before vLLM's hand edit
            head.markov_w1 = VocabParallelEmbedding(V, R)
            head.markov_w2 = ParallelLMHead(V, R, bias=False)
        g = torch.Generator().manual_seed(0)
        for layer in (head.markov_w1, head.markov_w2):
            full = torch.randn(V, R, generator=g)
            idx = getattr(layer, "shard_indices", None)
            lo, hi = (idx.org_vocab_start_index, idx.org_vocab_end_index) if idx else (0, V)
            with torch.no_grad():
                layer.weight.zero_()
                layer.weight[:hi - lo] = full[lo:hi]
            if hasattr(layer, "quant_method"):
                layer.quant_method.process_weights_after_loading(layer)
        d = Drafter()
        d.model = torch.nn.Module()
        d.model.markov_head = head
        d.logits_processor = LogitsProcessor(V)
        return d

    def positions(d, tokens):
        outs, events = [], []
        for prev in tokens:  # the speculator's sequential loop
            with record_collectives() as log:
                e = d.markov_embed(prev)
                outs += [e, d.markov_bias(e)]
            events.append([(ev.name, ev.shapes) for ev in log.events])
        return outs, events

    init_vllm_tp(2, shm=shm, reuse=True)
    tokens = [torch.tensor([3, 500, 999]), torch.tensor([0, 1, 998])]
    config = Config()
    shipped = drafter(sharded=False)
    left = not hook_markov_head(shipped, config) and "markov_embed" not in vars(shipped)
    sharded = drafter(sharded=True)
    want, before = positions(sharded, tokens)
    clear_reports()
    hooked = hook_markov_head(sharded, config)
    positions(sharded, tokens[:1])  # compiles (traced collectives, none sent)
    got, after = positions(sharded, tokens)
    reps = reports()
    return dict(left=left, hooked=hooked, equal=all(torch.equal(a, b) for a, b in zip(want, got)),
                before=before, after=after,
                rewrites=[(r.pass_name, r.pattern) for rep in reps for r in rep.rewrites],
                misses=[m.reason for rep in reps for m in rep.near_misses])


def test_sharded_markov_head_is_replicated(vllm_ranks):
    """vLLM's default communicator here: shared memory, or gloo where this CPU's vLLM
    build has none."""
    shm = shm_supported()
    for r in vllm_ranks.run(_heads, shm):
        assert r["left"] and r["hooked"] and r["equal"], r
        for events in r["before"]:  # sharded: an all-reduce and a gather per position
            assert [name for name, _ in events] == ["all_reduce", "all_gather"], r
        for events in r["after"]:  # the embedding's all-reduce is gone
            assert [name for name, _ in events] == ["all_gather"], r
        assert ("replicate_vocab_parallel", "vocab_parallel_embedding") in r["rewrites"], r
        assert any("packed weight" in m for m in r["misses"]), r
