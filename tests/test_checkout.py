"""commfold from a source checkout without an install (PYTHONPATH=., as the GPU check
runs it): passes/ and patterns/ load as commfold.passes and commfold.patterns."""
from __future__ import annotations

import sys
from pathlib import Path

from commfold import checkout

ROOT = Path(__file__).resolve().parent.parent


def test_finder_maps_the_checkouts_subpackages():
    finder = checkout._CheckoutFinder()
    for sub in ("passes", "patterns"):
        spec = finder.find_spec(f"commfold.{sub}")
        assert Path(spec.origin) == ROOT / sub / "__init__.py"
        assert spec.submodule_search_locations == [str(ROOT / sub)]
    assert finder.find_spec("commfold.ops") is None
    assert finder.find_spec("passes") is None


def test_installed_once():
    checkout.install()
    checkout.install()
    assert sum(isinstance(f, checkout._CheckoutFinder) for f in sys.meta_path) == 1
