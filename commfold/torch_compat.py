"""Which torch releases commfold supports, and the one place that asks which is loaded.

Proven range: torch 2.11 through 2.14 (tools/torch_matrix.py runs the suite on each;
docs/torch-matrix.md holds the last table and what each older release lacks).
Graph spellings that differ by release are handled by the recognizers themselves
(each spelling is matched wherever it appears);
the few version checks left in tests name the release a spelling comes from through
torch_version() here.
"""
from __future__ import annotations

import logging
import re
from functools import lru_cache

import torch

log = logging.getLogger("commfold")

SUPPORTED = ((2, 11), (2, 14))  # (first, last) major.minor, both included


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of the loaded torch (or of `version`), ignoring local tags."""
    m = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def supported(version: str | None = None) -> bool:
    return SUPPORTED[0] <= torch_version(version) <= SUPPORTED[1]


@lru_cache(maxsize=1)
def warn_if_unsupported() -> bool:
    """One warning per process when the loaded torch is outside the proven range (the
    passes still run: recognizers that meet a spelling they do not know skip the site
    and say why). True when supported."""
    ok = supported()
    if not ok:
        log.warning("commfold: torch %s is outside the tested range %d.%d-%d.%d; passes "
                    "run, but graph spellings may differ (run tools/torch_matrix.py %s to "
                    "check this torch)", torch.__version__, *SUPPORTED[0], *SUPPORTED[1],
                    torch.__version__.split("+")[0])
    return ok
