"""Several examples of a hypothesis strategy, drawn before a test runs them all in one
rank-pool call.

A `@given` test with max_examples=1 runs only hypothesis's simplest example (its first
try, whatever the seed), and each further example would be one more rank-pool call.
`drawn` collects the first distinct examples a seeded run generates past that simplest
one: the same ones every run (tests/conftest.py's fixed profile), fresh ones with
COMMFOLD_HYPOTHESIS=random.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings


def drawn(strategy, n: int, salt: int = 0) -> list:
    """n distinct examples of strategy (fewer only if it has fewer), skipping the
    simplest one; salt picks another fixed draw."""
    found: list = []

    @settings(max_examples=4 * n + 4, database=None, deadline=None, derandomize=False,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example):
        if example not in found:
            found.append(example)

    if os.environ.get("COMMFOLD_HYPOTHESIS") != "random":
        collect = hyp_seed(20261206 + salt)(collect)
    collect()
    return found[1:n + 1]
