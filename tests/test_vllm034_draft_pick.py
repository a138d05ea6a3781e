"""commfold's draft pick against vLLM 0.34's own classes (release tier: runs only where
vLLM 0.34's Model Runner V2 imports, e.g. the 0.34 venv with CUDA_VISIBLE_DEVICES=""
and TRITON_INTERPRET=1; skipped elsewhere), on 2 gloo ranks in a vLLM TP group:

- the hooked ``DraftModelSpeculator.sample_draft`` of a ``MultiModuleMTPSpeculator``
  (greedy drafting, each step with its module's head) equals 0.34's own method -
  ``greedy_argmax(compute_draft_logits(...))``: NaN as -inf, ties to the first index -
  bit for bit: ties across shards, vocab padding, NaN columns, all-NaN and -inf rows,
  bf16 (hypothesis draws the rows); rows where NaN would win an ``argmax`` are drawn,
  and no vocab-wide gather runs;
- under use_local_argmax_reduction, 0.34's ``get_draft_top_tokens`` calls commfold's
  installed ``get_top_tokens(h, spec_step_idx=i)``: the same tokens;
- the step log finds what each of 0.34's PyNccl collectives sends (its
  ``all_to_all_single`` included) by parameter name.

Run: CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 PYTHONPATH=$PWD \\
  /work/venv034/bin/python -m pytest -q -p no:xdist tests/test_vllm034_draft_pick.py
"""
from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec(
        "vllm.v1.worker.gpu.sample.greedy_argmax") is None:
    pytest.skip("needs vLLM 0.34's Model Runner V2 (greedy_argmax)", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harness.vllm_models import require_vllm_installed  # noqa: E402

pytestmark = require_vllm_installed()

V, H = 1000, 16
_state: dict = {}


def _setup():
    """vLLM's TP group on this gloo rank, the hook installed, the drafters (once)."""
    if _state:
        return _state
    import torch
    import torch.distributed as dist
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator import (
        MultiModuleMTPSpeculator)

    from harness import vllm_step

    ctx = set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))
    ctx.__enter__()
    rank = dist.get_rank()
    ps.init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo")
    ps.initialize_model_parallel(2)

    class Head(torch.nn.Module):
        def __init__(self, dtype, seed, nan_column):
            super().__init__()
            self.lm_head = ParallelLMHead(V, H, params_dtype=dtype)
            self.logits_processor = LogitsProcessor(V)
            g = torch.Generator().manual_seed(seed)
            full = torch.randint(-1, 2, (V, H), generator=g).float()  # ties
            full[nan_column] = float("nan")  # that token's logit NaN in every row
            idx = self.lm_head.shard_indices
            n = idx.org_vocab_end_index - idx.org_vocab_start_index
            with torch.no_grad():
                self.lm_head.weight.fill_(3.0)  # padding rows: would win unmasked
                self.lm_head.weight[:n] = full[idx.org_vocab_start_index:
                                               idx.org_vocab_end_index].to(dtype)

        def forward(self, h):
            return self.logits_processor(self.lm_head, h)

    class TwoModuleMTP(torch.nn.Module):
        """DeepSeek's MTP drafter's logits end: module i % 2's head per step (the
        first's NaN column on rank 0's shard, the second's on rank 1's)."""

        def __init__(self, dtype):
            super().__init__()
            self.heads = torch.nn.ModuleList([Head(dtype, 1, 7), Head(dtype, 2, 700)])

        def compute_logits(self, hidden, spec_step_idx: int = 0):
            return self.heads[spec_step_idx % 2](hidden)

    class Speculator(MultiModuleMTPSpeculator):  # what sample_draft reads, nothing built
        pass

    _state.update(original=vllm_step.hook_v2_draft_pick(), Speculator=Speculator,
                  models={d: TwoModuleMTP(getattr(torch, d)) for d in ("float32", "bfloat16")})
    return _state


def _hidden(rows: list[str], dtype, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-1, 2, (len(rows), H), generator=g).float()
    for i, kind in enumerate(rows):
        if kind == "ones":
            h[i] = 1.0  # the padding rows would win
        elif kind == "nan":
            h[i] = float("nan")  # every logit NaN
        elif kind == "inf":
            h[i] = 0.0
            h[i, 3] = float("-inf")  # +-inf logits, NaN where a weight is 0
        elif kind == "zero":
            h[i] = 0.0  # all logits 0 (NaN column aside): ties across both shards
    return h.to(dtype)


def _picks(cases: list[dict]) -> list[dict]:
    import torch
    from vllm.v1.worker.gpu.sample.greedy_argmax import greedy_argmax

    from commfold.distributed.comm_log import record_collectives

    s = _setup()
    out = []
    for case in cases:
        model = s["models"][case["dtype"]]
        spec = s.get((case["dtype"], case["local"]))
        if spec is None:  # one per drafter and path: its picks compile once
            spec = s[case["dtype"], case["local"]] = s["Speculator"].__new__(s["Speculator"])
            spec.model, spec.use_local_argmax_reduction = model, case["local"]
            spec.acceptance_estimator = None
            spec.speculative_config = type("C", (), {"draft_sample_method": "greedy"})()
            # local: installs commfold's get_top_tokens (the drafter has none)
            spec._validate_local_argmax_reduction()
        h = _hidden(case["rows"], model.heads[0].lm_head.weight.dtype, case["seed"])
        args = (None, None, None, None, None, None, case["step"])  # greedy drafting
        logits = model.compute_logits(h, spec_step_idx=case["step"])
        theirs = s["original"](spec, h, *args)  # 0.34's sample_draft, local or not
        spec.sample_draft(h, *args)  # compiles the pick (traced gathers: not sent)
        with record_collectives() as log:
            ours = spec.sample_draft(h, *args)
        out.append(dict(
            case=case, ours=ours.tolist(),
            equal=ours.dtype == theirs.dtype and torch.equal(ours, theirs),
            greedy=torch.equal(ours, greedy_argmax(logits)),
            nan_would_win=bool((logits.argmax(-1) != greedy_argmax(logits)).any()),
            wide=[e.shapes for e in log.events if e.name in ("all_gather", "gather")
                  and any(sh and sh[-1] >= V // 2 for sh in e.shapes)]))
    return out


ROW = st.sampled_from(["ties", "ones", "nan", "inf", "zero"])
CASE = st.fixed_dictionaries({"dtype": st.sampled_from(["float32", "bfloat16"]),
                              "step": st.integers(0, 1), "seed": st.integers(0, 2**16),
                              "local": st.booleans(),
                              "rows": st.lists(ROW, min_size=2, max_size=6)})


@pytest.fixture(scope="module")
def ranks():
    from commfold.distributed.ranks import RankPool

    with RankPool(2, timeout=900) as pool:
        yield pool


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(CASE, min_size=6, max_size=6))
def test_draft_pick_equals_034_sample_draft(ranks, cases):
    r0, r1 = ranks.run(_picks, cases)
    assert [r["ours"] for r in r0] == [r["ours"] for r in r1]
    for r in r0 + r1:
        assert r["equal"] and r["greedy"], r
        assert r["wide"] == [], r  # no vocab-wide gather, local_argmax or not
    assert any(r["nan_would_win"] for r in r0)  # the NaN columns: argmax would differ


def test_draft_pick_nan_rule_of_034():
    from commfold.vllm.spec_decode import draft_v2

    assert draft_v2.v2_nan_as_neginf() is True


def test_step_log_finds_what_034s_pynccl_sends():
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    from commfold.vllm.observe.step_log import pynccl_sent

    sent = pynccl_sent(PyNcclCommunicator)
    assert sent["all_to_all_single"] == ("all_to_all", 1, "input_tensor"), sent
    assert sent["all_gather"] == ("all_gather", 1, "input_tensor"), sent
    assert sent["all_reduce"] == ("all_reduce", 0, "in_tensor"), sent
    assert not [m for m, s in sent.items() if isinstance(s, str)], sent
