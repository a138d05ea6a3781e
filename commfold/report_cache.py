"""Reports for cache hits. When Inductor's FX graph cache serves a compiled graph,
commfold's pass does not run (the cache key holds its uuid, so the cached code is
the rewritten one); the backend then republishes the report saved when that graph
was first compiled, so last_report() is the same on a hit as on a miss."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from commfold.report import Report


def _dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "commfold-reports"


def graph_key(gm: torch.fx.GraphModule, example_inputs, uuid: str | None) -> str | None:
    if uuid is None:
        return None
    h = hashlib.sha256(uuid.encode())
    h.update(gm.code.encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            h.update(f"{tuple(x.shape)}{x.dtype}{x.stride()}{x.device.type}".encode())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()


def save(key: str, reports: list[Report]) -> None:
    try:
        d = _dir()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps([r.to_dict() for r in reports]))
        os.replace(tmp, d / f"{key}.json")
    except OSError:
        pass  # a report cache is a convenience; never fail a compile for it


def load(key: str) -> list[Report]:
    try:
        data = json.loads((_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return []
    out = []
    for d in data:
        r = Report.from_dict(d)
        r.from_cache = True
        out.append(r)
    return out
