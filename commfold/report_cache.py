"""Reports for cache hits. When Inductor's FX graph cache serves a compiled graph,
commfold's pass does not run (the cache key holds its uuid, so the cached code is
the rewritten one); the backend then republishes the report saved when that graph
was first compiled, so last_report() is the same on a hit as on a miss.

Inductor's key ignores stack traces: a graph served from its cache may come from
source lines that have since moved (a comment added above, a file renamed). The saved
report keeps the source location of every graph node, so a hit rewrites the
locations it names to where the same nodes are now."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from commfold.report import Report, source_location


def _dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "commfold-reports"


def graph_key(gm: torch.fx.GraphModule, example_inputs, uuid: str | None) -> str | None:
    if uuid is None:
        return None
    h = hashlib.sha256(uuid.encode())
    # Inductor's own key holds torch's version: a graph another torch compiled from
    # the same code (cache dirs are shared across venvs) had another rewrite
    h.update(torch.__version__.encode())
    h.update(gm.code.encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            h.update(f"{tuple(x.shape)}{x.dtype}{x.stride()}{x.device.type}".encode())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()


def locations(gm: torch.fx.GraphModule) -> list[str]:
    """Each node's source location, in graph order (the key fixes the order)."""
    return [source_location(n) for n in gm.graph.nodes]


def save(key: str, reports: list[Report], where: list[str]) -> None:
    try:
        d = _dir()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"where": where, "reports": [r.to_dict() for r in reports]}))
        os.replace(tmp, d / f"{key}.json")
    except OSError:
        pass  # a report cache is a convenience; never fail a compile for it


def load(key: str, where: list[str]) -> list[Report]:
    """The reports saved under key, their source locations moved to `where`."""
    try:
        saved = json.loads((_dir() / f"{key}.json").read_text())
        text = json.dumps(saved["reports"])
        moved = {old: new for old, new in zip(saved["where"], where) if old != new}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if moved and len(saved["where"]) == len(where):
        alts = "|".join(re.escape(json.dumps(o)[1:-1]) for o in sorted(moved, key=len,
                                                                        reverse=True))
        esc = {json.dumps(o)[1:-1]: json.dumps(n)[1:-1] for o, n in moved.items()}
        text = re.sub(rf"(?<![\w./-])(?:{alts})", lambda m: esc[m[0]], text)
    out = []
    for d in json.loads(text):
        r = Report.from_dict(d)
        r.from_cache = True
        out.append(r)
    return out
