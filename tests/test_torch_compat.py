"""commfold.torch_compat: the supported torch range and its one warning."""
from __future__ import annotations

import logging

import pytest
import torch

from commfold import torch_compat


@pytest.mark.parametrize("version, expected", [
    ("2.13.0+cpu", (2, 13)), ("2.14.1+cu130", (2, 14)), ("2.11.0", (2, 11)),
    ("2.15.0.dev20261201", (2, 15)), ("garbage", (0, 0))])
def test_torch_version_parses_release_strings(version, expected):
    assert torch_compat.torch_version(version) == expected


def test_supported_range_is_2_11_to_2_14():
    assert [torch_compat.supported(v) for v in ("2.10.0", "2.11.0", "2.12.1", "2.13.0",
                                                "2.14.1", "2.15.0")] \
        == [False, True, True, True, True, False]
    assert torch_compat.supported()  # the suite itself runs on a supported torch


def test_outside_the_range_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    torch_compat.warn_if_unsupported.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="commfold"):
            assert not torch_compat.warn_if_unsupported()
            assert not torch_compat.warn_if_unsupported()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "torch 2.15.0 is outside the tested range 2.11-2.14" \
            in lines[0]
    finally:
        torch_compat.warn_if_unsupported.cache_clear()
