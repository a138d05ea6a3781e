"""The pass registry and the typed options, without ranks."""
from __future__ import annotations

from pathlib import Path

import pytest

import commfold
from commfold.config import unknown_passes
from commfold.passes import PASSES

ROOT = Path(__file__).resolve().parent.parent


def test_every_pass_module_is_registered_once_in_order():
    modules = {p.stem for p in (ROOT / "passes").glob("*.py") if p.stem != "__init__"}
    assert set(commfold.ALL_PASSES) == modules  # a pass module nobody runs, or a name
    assert commfold.ALL_PASSES == tuple(PASSES) == commfold.Config().passes  # without one
    assert all(PASSES[name].__module__ == f"commfold.passes.{name}" for name in PASSES)
    assert unknown_passes(["local_argmax", "bogus"]) == ["bogus"]


def test_two_shot_threshold_is_a_field_in_the_cache_key():
    default, forced = commfold.Config(), commfold.Config(two_shot_min_bytes=0)
    assert default.two_shot_min_bytes == -1  # off: measured slower on gloo
    assert default.key() != forced.key()
    assert commfold.CommfoldPass(default).uuid() != commfold.CommfoldPass(forced).uuid()
    assert commfold.backend(two_shot_min_bytes=4096).config.two_shot_min_bytes == 4096
    with pytest.raises(ValueError, match="two_shot_min_bytes"):
        commfold.Config(two_shot_min_bytes=-2)
