"""The bounded soak (tools/server_soak.py): mixed traffic at concurrency 8 - greedy,
seeded sampled, logprobs, streams aborted after two chunks - for a few minutes against
vLLM's OpenAI server without and then with commfold: no error, the server healthy and
idle after it, the seeded requests answered the same by both, each TP worker's
resident memory flat after warm-up.

`slow` (~2 x (start + COMMFOLD_SOAK_SECONDS, default 120 s) on 2 shared cores):
`python -m pytest -n 0 -m slow tests/test_vllm_server_soak.py -s`.
"""
from __future__ import annotations

import json
import os

import pytest

from harness.vllm_models import require_vllm_installed

pytestmark = [*require_vllm_installed(group="module"), pytest.mark.engine, pytest.mark.slow]

from tools.server_soak import soak  # noqa: E402

# a worker's RSS may move by allocator noise, not by a per-step leak: at ~10 steps a
# second for minutes, a leak of even 1 KiB a step would pass this
RSS_SLACK_KIB = 64 * 1024


def test_soak(tmp_path):
    out = soak(tmp_path, float(os.environ.get("COMMFOLD_SOAK_SECONDS", 120)), 8)
    for name in ("off", "on"):
        run = out[name]
        print(name, json.dumps({k: v for k, v in run.items() if k != "results"}))
        assert run["errors"] == [], run["errors"][:5]
        assert run["served"] > 50 and all(run["by_kind"].values()), run["by_kind"]
        assert run["healthy_after"] and run["running_after"] == run["waiting_after"] == 0
        assert sorted(run["rss_warm_kib"]) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
        for w, warm in run["rss_warm_kib"].items():
            assert run["rss_end_kib"][w] - warm <= RSS_SLACK_KIB, (name, w, run)
    print("compare", out["compare"])
    assert out["compare"]["compared"] > 50 and out["compare"]["differ"] == []
