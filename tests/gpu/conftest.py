"""The GPU check's fixtures and its table rows.

``gpu_ranks``: 2 gloo ranks sharing the one device (a new pool after a failed call),
spawned: a rank forked from a server whose imports touched the CUDA driver could not
use the GPU.
Rows: with COMMFOLD_GPU_CHECK_ROWS set, each test appends one JSON line - check,
result (passed / FAILED: why / skipped: why), numbers (the test's ``numbers``
property, set through ``record_property``) - for tools/gpu_check_table.py.
tools/gpu_check.sh runs these tests without tests/conftest.py (--confcutdir), so
this file puts the checkout root on sys.path for the shared logit cases
(harness/logit_cases.py) itself."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from gpu_device import DEVICE

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

WORLD = 2
# a hung collective fails within the check's 5 minutes; CPU mode compiles slowly
CALL_TIMEOUT_S = 180.0 if DEVICE == "cuda" else 900.0


class GpuRanks:
    """2 ranks; run(fn, *args) -> their results in rank order."""

    world_size = WORLD

    def __init__(self):
        self._pool = None

    def run(self, fn, *args, **kwargs) -> list:
        from commfold.distributed.ranks import RankPool

        if self._pool is None or not self._pool.alive:
            self._pool = RankPool(WORLD, timeout=CALL_TIMEOUT_S, spawn=True)
        return self._pool.run(fn, *args, **kwargs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


@pytest.fixture(scope="session")
def gpu_ranks():
    ranks = GpuRanks()
    yield ranks
    ranks.close()


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*")


def short_error(text: str) -> str:
    """The first exception line of a failure (a RankError lists root causes first)."""
    for line in text.splitlines():
        if _ERROR_LINE.match(line.strip()) and not line.startswith(
                "commfold.distributed.ranks.RankError"):
            return line.strip()[:200]
    return text.strip().splitlines()[0][:200] if text.strip() else "failed"


def _result(report, call) -> str:
    if report.passed:
        return "passed"
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return "skipped: " + reason.removeprefix("Skipped: ")
    text = call.excinfo.exconly() if call.excinfo is not None else str(report.longrepr)
    return "FAILED: " + short_error(text)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    path = os.environ.get("COMMFOLD_GPU_CHECK_ROWS")
    if not path or (report.when != "call" and report.passed):
        return
    area = item.module.__name__.removeprefix("test_gpu_")
    row = {"check": f"{area}: {item.name.removeprefix('test_')}",
           "result": _result(report, call),
           "numbers": dict(report.user_properties).get("numbers", "")}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
