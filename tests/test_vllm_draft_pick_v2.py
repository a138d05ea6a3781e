"""commfold's draft pick inside Model Runner V2's speculator: vLLM's own
``DraftModelSpeculator.sample_draft`` (greedy drafting: ``compute_draft_logits(...)
.argmax(-1)``, a full-vocab gather per draft step) against the same method under
commfold's hook (commfold.vllm.spec_decode.draft), on vLLM's real ParallelLMHead +
LogitsProcessor in a vLLM TP=2 group: identical draft tokens (ties across shards,
vocab padding, bf16), one (value, index) pair per row per rank instead of the
gather; a speculator with an acceptance estimator (adaptive verification reads the
full logits) or with use_local_argmax_reduction keeps vLLM's path."""
from __future__ import annotations

from harness.vllm_models import init_vllm_tp, require_vllm_installed, shm_supported

pytestmark = require_vllm_installed(group="module")  # Model Runner V2: off the vLLM worker's chain

V = 1500


def _sample_both_ways(shm: bool, cases: list[dict]) -> list[dict]:
    from types import SimpleNamespace

    import torch
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    from commfold.distributed.comm_log import record_collectives
    from harness import vllm_step

    class Speculator(DraftModelSpeculator):  # what sample_draft reads, nothing built
        capture = init_cudagraph_manager = load_draft_model = propose = None

    init_vllm_tp(2, shm=shm, reuse=True)
    original = vllm_step.hook_v2_draft_pick()
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        model = vllm_step.TinyLM(V, dtype, case["seed"], case["ties"])
        spec = Speculator.__new__(Speculator)
        spec.model, spec.use_local_argmax_reduction = model, case.get("local", False)
        seen = []  # what vLLM's acceptance estimator is handed: the full logits
        spec.acceptance_estimator = SimpleNamespace(
            predict=lambda logits, *a, seen=seen: seen.append(tuple(logits.shape))) \
            if case.get("estimator") else None
        spec.draft_token_confidence_probs = spec.temperature = None
        if case.get("local"):
            model.get_top_tokens = lambda h, m=model: m.compute_logits(h).argmax(-1)
        h = vllm_step.hidden(case["rows"], dtype, case["seed"] + 1, case["ties"])
        args = (None, None, None, None, None, None)  # greedy drafting: no draft_logits
        with record_collectives() as vllm_log:
            theirs = original(spec, h, *args)
        spec.sample_draft(h, *args)  # compiles commfold's pick (traced gathers: not sent)
        with record_collectives() as ours_log:
            ours = spec.sample_draft(h, *args)
        shard = model.lm_head.weight.shape[0]
        out.append(dict(case=case, equal=torch.equal(ours, theirs),
                        picked="_commfold_pick" in spec.__dict__
                        and spec._commfold_pick is not None,
                        ours=[(e.name, e.shapes) for e in ours_log.events if e.name in (
                            "all_gather", "gather") and any(s and s[-1] >= shard
                                                            for s in e.shapes)],
                        vllm_gathers=vllm_log.calls()))
    return out


CASES = [
    dict(dtype="float32", seed=1, ties=True, rows=5),
    dict(dtype="bfloat16", seed=2, ties=False, rows=1),
    dict(dtype="float32", seed=3, ties=True, rows=3, estimator=True),
    dict(dtype="float32", seed=4, ties=True, rows=3, local=True),
]


def test_v2_draft_pick_equals_v2s_sample_draft(vllm_ranks):
    """vLLM's default communicator here: shared memory, or gloo where this CPU's vLLM
    build has none."""
    shm = shm_supported()
    for res in vllm_ranks.run(_sample_both_ways, shm, CASES):
        for r in res:
            assert r["equal"], r["case"]
            mine = not (r["case"].get("estimator") or r["case"].get("local"))
            assert r["picked"] == mine, r["case"]
            assert (r["ours"] == []) == mine, r  # no vocab-wide gather where commfold picks
            assert r["vllm_gathers"] >= 1 or r["case"].get("local"), r
