"""The V2 draft pick returns commfold's tokens in place of sample_draft's own greedy
pick, so it acts only on a sample_draft whose whole source commfold checked (pinned
per release by digest): the installed vLLM's is pinned and its pick is on; any other
body turns the pick off with a line naming the method and the digest."""
from __future__ import annotations

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed()


def _pick_state():
    from commfold.config import Config
    from commfold.vllm.spec_decode import draft
    from commfold.vllm.compat.runtime import Runner

    (pick, _) = draft.states(Config(passes=("local_argmax",)), {}, Runner(2, "test"))
    return pick


def test_installed_sample_draft_is_pinned():
    from commfold.vllm.spec_decode import draft_v2

    assert draft_v2.sample_draft_unpinned() == []
    assert _pick_state().on, _pick_state()


def test_another_sample_draft_turns_the_pick_off(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    original = DraftModelSpeculator.__dict__["sample_draft"]

    def sample_draft(self, hidden_states, *args, **kwargs):  # a body commfold has not read
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(DraftModelSpeculator, "sample_draft", sample_draft)
    state = _pick_state()
    assert not state.on and "DraftModelSpeculator.sample_draft: its source (sha256 " in \
        state.reason, state
