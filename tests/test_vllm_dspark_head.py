"""DSpark's Markov head (vLLM's Qwen3DSparkForCausalLM.markov_embed / markov_bias, run
eagerly once per draft position by Model Runner V2's DSpark speculator) in a vLLM TP=2
group: as vLLM ships it (replicated by hand) commfold leaves it alone; built sharded,
as before vLLM's hand edit, commfold.vllm.spec_decode.eager_heads rebuilds both layers replicated
at load: no collective per position, values bit-identical to the unrewritten sharded
head's and to the replicated head vLLM ships; a size limit that excludes them keeps
them sharded, said in the log line."""
from __future__ import annotations

from harness.vllm_models import init_vllm_tp, require_vllm_installed, shm_supported

pytestmark = require_vllm_installed(group="module")  # Model Runner V2: off the vLLM worker's chain

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
    from commfold.vllm.spec_decode.eager_heads import hook_markov_head
    from harness.dspark_block import commfold_lines

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
    with commfold_lines() as lines:
        left = not hook_markov_head(shipped, config)
        shipped_outs, _ = positions(shipped, tokens)
        sharded = drafter(sharded=True)
        want, before = positions(sharded, tokens)
        hooked = hook_markov_head(sharded, config)
        got, after = positions(sharded, tokens)
        small = drafter(sharded=True)  # a limit the layers are over: kept sharded
        kept = not hook_markov_head(small, Config(replicate_max_bytes=V * R * 4 - 1))
        kept_outs, kept_events = positions(small, tokens)
    return dict(left=left, hooked=hooked, kept=kept, before=before, after=after,
                kept_events=kept_events, lines=list(lines),
                equal=all(torch.equal(a, b) for a, b in zip(want, got)),
                as_shipped=all(torch.equal(a, b) for a, b in zip(shipped_outs, got)),
                kept_equal=all(torch.equal(a, b) for a, b in zip(want, kept_outs)),
                layers=[type(m).__name__ for m in (sharded.model.markov_head.markov_w1,
                                                   sharded.model.markov_head.markov_w2)])


def test_sharded_markov_head_is_replicated(vllm_ranks):
    """vLLM's default communicator here: shared memory, or gloo where this CPU's vLLM
    build has none."""
    shm = shm_supported()
    for r in vllm_ranks.run(_heads, shm):
        assert r["left"] and r["hooked"] and r["kept"], r
        assert r["equal"] and r["as_shipped"] and r["kept_equal"], r
        for events in r["before"] + r["kept_events"]:  # sharded: all-reduce + gather
            assert [name for name, _ in events] == ["all_reduce", "all_gather"], r
        assert r["after"] == [[], []], r  # replicated: no collective per position
        assert r["layers"] == ["VocabParallelEmbedding", "ParallelLMHead"], r
        said = [line for line in r["lines"] if "Markov head" in line]
        assert len(said) == 3 and "replicated already" in said[0], said
        assert "replicated markov_w1 (64000 B), markov_w2 (64000 B)" in said[1], said
        over = "kept sharded markov_w1: full weight 64000 B over replicate_max_bytes"
        assert over in said[2], said
