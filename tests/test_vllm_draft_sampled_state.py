"""The probabilistic draft pick's switch and its refusals (commfold.vllm.spec_decode.draft_sampled),
without ranks: one line at load, on or off and why (its pins, the draft pick, sampled
verification); the configurations it leaves to V2's sample_draft, each with its
reason; the cache bookkeeping (commfold.vllm.spec_decode.draft_cache) on one rank."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed()

V2 = dict(version=2, why="test")


def _state(environ):
    from commfold.vllm.spec_decode import draft_sampled
    from commfold.vllm.compat.runtime import Runner

    return draft_sampled.state(environ, Runner(**V2))


def test_on_with_the_installed_vllm():
    from commfold.vllm.compat import hooks, releases
    from commfold.vllm.compat.runtime import Runner

    state = _state({})
    assert state.on, state
    names = [h.name for h in hooks.of(Runner(**V2), (0, 32, 0))]
    name = "draft pick: probabilistic"
    assert name in names
    for release, detail in (((0, 33), "cache tensor"), ((0, 34), "DraftLogitsCache")):
        found = [h for h in hooks.of(Runner(**V2), release) if h.name == name]
        assert [h.detail.split(",")[0] for h in found] == [detail], release
    # a newer vLLM is read as the newest claimed release: its set, if its pins hold
    read_as = releases.here_for(("vllm", "0.35.0")).numbers
    found = [h for h in hooks.of(Runner(**V2), read_as) if h.name == name]
    assert [h.detail.split(",")[0] for h in found] == ["DraftLogitsCache"]


@pytest.mark.parametrize("environ,why", [
    ({"COMMFOLD_TARGET_PICK": "0"}, "sampled verification stays V2's"),
    ({"COMMFOLD_PASSES": "fuse_allreduce_rmsnorm"}, "COMMFOLD_PASSES has none of"),
])
def test_off_says_why(environ, why):
    state = _state(environ)
    assert not state.on and state.reason.startswith(why), state


def test_a_moved_pin_turns_it_off(monkeypatch):
    from vllm.v1.worker.gpu.sample import gumbel

    def gumbel_sample(*args, **kwargs):  # a body commfold has not read
        return None

    from commfold.vllm.compat import hook_points

    monkeypatch.setattr(gumbel, "gumbel_sample", gumbel_sample)
    hook_points._missing.cache_clear()  # read once a process: read again
    try:
        state = _state({})
    finally:
        monkeypatch.undo()
        hook_points._missing.cache_clear()
    assert not state.on and "gumbel_sample changed" in state.reason, state


def _spec(**kw):
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    class Speculator(DraftModelSpeculator):
        capture = init_cudagraph_manager = load_draft_model = propose = None

    spec = Speculator.__new__(Speculator)
    spec.draft_watermarker = spec.acceptance_estimator = None
    spec.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
        enable_batch_sharded_sampling=False, pipeline_parallel_size=1), lora_config=None)
    spec.model = None
    for k, v in kw.items():
        setattr(spec, k, v)
    return spec


@pytest.mark.parametrize("kw,why", [
    (dict(draft_watermarker=object()), "watermarked drafting"),
    (dict(acceptance_estimator=object()), "acceptance estimator"),
    (dict(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(
        enable_batch_sharded_sampling=True))), "batch-sharded sampling"),
    (dict(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(
        prefill_context_parallel_size=2))), "prefill context parallelism"),
    (dict(model=SimpleNamespace(draft_id_to_target_id=object())), "EAGLE-3's d2t"),
    # vLLM 0.34's DraftLogitsCache holding only this rank's requests
    ({}, "batch-sharded sampling"),
])
def test_refusals(kw, why):
    import torch

    from commfold.vllm.spec_decode import draft_sampled

    given = {} if kw else {"draft_logits": SimpleNamespace(
        values=torch.zeros(2, 1, 8), row_mapping=torch.tensor([0, -1]))}
    assert why in draft_sampled.refusal(_spec(**kw), given)


@pytest.mark.parametrize("vocab,world,why", [
    (3000, 2, "sends no fewer bytes"), (32000, 2, None), (20011, 4, "sends no fewer bytes")])
def test_a_vocab_with_no_saving_stays_v2s(vocab, world, why, monkeypatch):
    """Where verifying from the shards would send no fewer bytes than vLLM's gather
    (commfold.shard.layout.no_saving), the drafts stay V2's too (their cache would be gathered
    back at every target step); COMMFOLD_PICK_COST_RULE=0 takes them."""
    import torch

    from commfold.vllm.spec_decode import draft_sampled
    from commfold.vllm.target import pick_cost

    spec = _spec()
    shard = -(-vocab // 64) * 64 // world
    spec._commfold_sampled_head = (SimpleNamespace(
        model_dtype=torch.bfloat16, vocab=vocab, shard=shard,
        head=SimpleNamespace(world=world)), "")
    given = {"draft_logits": torch.zeros(4, 2, vocab, dtype=torch.bfloat16),
             "draft_step": torch.tensor(0)}
    got = draft_sampled.refusal(spec, given)
    assert (got is None) if why is None else (why in got), got
    monkeypatch.setenv(pick_cost.ENV, "0")
    assert draft_sampled.refusal(spec, given) is None


def test_cache_bookkeeping_one_rank():
    """record / prepare_verify on one rank: a draft that is not the recorded token asks
    for whole rows (complete is then a no-op without dirty slots)."""
    import torch

    from commfold.vllm.spec_decode import draft_cache

    cache = torch.zeros(4, 2, 10)
    assert draft_cache.of(cache) is None
    found = draft_cache.filled(cache, "c10d:none", 5, 10)
    slots = torch.tensor([1, -1])
    draft_cache.record(cache, slots, 0, torch.tensor([7, 3]), partial=True)
    assert found.dirty.tolist() == [False, True, False, False]
    assert found.tokens[:, 0].tolist() == [-1, 7, -1, -1]
    draft_cache.record(cache, torch.tensor([2]), 1, torch.tensor([4]), partial=False)
    assert found.dirty.tolist() == [False, True, False, False]
    found.dirty[1] = False  # nothing partial: no collective is needed
    assert draft_cache.complete(cache, torch.tensor([1, 2])) == 0
