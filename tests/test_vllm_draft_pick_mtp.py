"""commfold's draft pick in Model Runner V2's multi-module MTP speculator (vLLM's
``MultiModuleMTPSpeculator``: one MTP module, with its own LM head, per draft step;
its ``compute_draft_logits`` passes ``spec_step_idx`` to the drafter), on vLLM's real
ParallelLMHead + LogitsProcessor in a vLLM TP=2 group:

- greedy drafting: the hooked ``sample_draft`` picks each step with that step's head,
  the tokens of vLLM's own method (ties across shards, vocab padding, bf16), one
  (value, index) pair per row per rank instead of the full-vocab gather;
- use_local_argmax_reduction with a drafter without get_top_tokens: commfold's
  installed one takes vLLM's call ``get_top_tokens(h, spec_step_idx=i)`` (no
  TypeError) and picks with step i's head, the same tokens, no vocab gather;
- a speculator whose compute_draft_logits commfold does not know keeps vLLM's pick,
  and one log line names its class and says why."""
from __future__ import annotations

from harness.vllm_models import init_vllm_tp, require_vllm_installed, shm_supported

pytestmark = require_vllm_installed()

V = 1500


def _run(shm: bool, cases: list[dict]) -> list[dict]:
    import logging

    import torch
    from vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator import (
        MultiModuleMTPSpeculator)
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    from commfold.distributed.comm_log import record_collectives
    from harness import vllm_step

    class TwoModuleMTP(torch.nn.Module):
        """DeepSeek's MTP drafter's logits end: module i % 2's head per step, named as
        DeepSeek names its layers (str of an int: a graph break if that int were
        symbolic in the compiled pick)."""

        def __init__(self, dtype, seed, ties):
            super().__init__()
            self.start, self.num_layers = 2, 2
            self.layers = torch.nn.ModuleDict(
                {str(self.start + i): vllm_step.TinyLM(V, dtype, seed + i, ties)
                 for i in range(2)})

        def compute_logits(self, hidden, spec_step_idx: int = 0):
            layer = self.layers[str(self.start + spec_step_idx % self.num_layers)]
            return layer.compute_logits(hidden)

    class Speculator(MultiModuleMTPSpeculator):  # what sample_draft reads, nothing built
        pass

    class Unknown(DraftModelSpeculator):
        capture = init_cudagraph_manager = load_draft_model = propose = None

        def compute_draft_logits(self, hidden_states, spec_step_idx):
            return self.model.compute_logits(hidden_states, spec_step_idx=spec_step_idx)

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("commfold").addHandler(handler)
    logging.getLogger("commfold").setLevel(logging.INFO)

    init_vllm_tp(2, shm=shm, reuse=True)
    original = vllm_step.hook_v2_draft_pick()
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        model = TwoModuleMTP(dtype, case["seed"], case["ties"])
        cls = Unknown if case.get("unknown") else Speculator
        spec = cls.__new__(cls)
        spec.model, spec.use_local_argmax_reduction = model, case.get("local", False)
        spec.acceptance_estimator = None
        spec.draft_token_confidence_probs = spec.temperature = None
        if case.get("local"):
            spec.speculative_config = type("C", (), {"draft_sample_method": "greedy"})()
            try:
                spec._validate_local_argmax_reduction()  # installs commfold's get_top_tokens
            except ValueError as e:
                out.append(dict(case=case, refused=str(e)))
                continue
        shard = model.layers["2"].lm_head.weight.shape[0]
        steps = []
        for step in range(1 if case.get("unknown") else 2):
            h = vllm_step.hidden(case["rows"], dtype, case["seed"] + 10 + step, case["ties"])
            args = (None, None, None, None, None, None, step)  # greedy: no draft_logits
            want = model.compute_logits(h, spec_step_idx=step).argmax(-1)  # vLLM's pick
            with record_collectives() as vllm_log:
                theirs = original(spec, h, *args)
            spec.sample_draft(h, *args)  # compiles the pick (traced gathers: not sent)
            with record_collectives() as ours_log:
                ours = spec.sample_draft(h, *args)
            steps.append(dict(
                equal=torch.equal(ours, theirs) and torch.equal(ours, want),
                other_head_differs=not torch.equal(
                    ours, model.compute_logits(h, spec_step_idx=step + 1).argmax(-1)),
                wide=[(e.name, e.shapes) for e in ours_log.events
                      if e.name in ("all_gather", "gather")
                      and any(s and s[-1] >= shard for s in e.shapes)],
                vllm_calls=vllm_log.calls()))
        out.append(dict(case=case, steps=steps,
                        installed=type(model.__dict__.get("get_top_tokens")).__name__,
                        lines=[x for x in lines if type(spec).__name__ in x]))
    return out


CASES = [
    dict(dtype="bfloat16", seed=2, ties=True, rows=5),
    dict(dtype="float32", seed=3, ties=True, rows=4, local=True),
    dict(dtype="float32", seed=4, ties=True, rows=3, unknown=True),
]


def test_multi_module_mtp_draft_pick(vllm_ranks):
    results = vllm_ranks.run(_run, shm_supported(), CASES)
    for res in results:
        for r in res:
            case = r["case"]
            assert "refused" not in r, r
            assert r["steps"] and all(s["equal"] for s in r["steps"]), r
            # each step picked with its own module's head: the other head's pick differs
            assert any(s["other_head_differs"] for s in r["steps"]) or case.get("unknown"), r
            if case.get("unknown"):
                assert all(s["wide"] for s in r["steps"]), r  # vLLM's gather
                assert r["lines"] == [
                    "commfold: Unknown's draft tokens are vLLM's pick, with its full-vocab "
                    "gather: its compute_draft_logits (_run.<locals>.Unknown's) is not one "
                    "commfold knows"], r
            else:
                assert all(s["wide"] == [] for s in r["steps"]), r  # no vocab-wide gather
                assert all(s["vllm_calls"] >= 1 for s in r["steps"]), r
                assert r["installed"] == ("StepPicks" if case.get("local") else "NoneType"), r
                assert not any("vLLM's pick" in x for x in r["lines"]), r
