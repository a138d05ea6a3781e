"""The whole-source pins of the vLLM functions hooks stand in for, from one table.

A hook that returns what a vLLM function would pins that function's whole source
(hook_points.Pinned): ``pins.json`` beside this file holds, for every such
'module:Attr.path', its ``hook_points.source_hash`` in each claimed release
(commfold.vllm.compat.releases) where it exists. The table is generated from the
releases' wheels by ``tools/vllm_release.py`` (``add``, ``pin``, ``check``), never
typed: a hook asks ``pinned(where)`` and gets the releases the tool read, so adding
a release is one command, and a function pinned by several hooks has one entry.
$COMMFOLD_PINS_TABLE names another table: the candidate the tool's ``add`` checks a new
release's hook points with before it is accepted (read at commfold's import).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from commfold.vllm.compat.hook_points import Pinned
from commfold.vllm.compat.releases import parse

TABLE = Path(os.environ.get("COMMFOLD_PINS_TABLE") or Path(__file__).with_name("pins.json"))


@functools.cache  # read once a process
def table() -> dict[str, dict[str, str]]:
    """'module:Attr.path' -> {release: source hash} (the note keys left out)."""
    data = json.loads(TABLE.read_text())
    return {where: rows for where, rows in data.items() if not where.startswith("_")}


def pinned(where: str, since: tuple[int, ...] | None = None,
           until: tuple[int, ...] | None = None) -> Pinned:
    """`where`'s pins, oldest release first; `since`/`until` keep the releases in
    [since, until) (a hook set that covers only those, as its HookSet's range).
    KeyError when the tool never pinned `where`."""
    rows = table().get(where)
    if rows is None:
        raise KeyError(f"commfold: {where} is not pinned in {TABLE.name}: pin it with "
                       f"`python tools/vllm_release.py pin '{where}'`")
    kept = sorted(((parse(v) or (), v, h) for v, h in rows.items()
                   if (since is None or (parse(v) or ()) >= since)
                   and (until is None or (parse(v) or ()) < until)))
    return Pinned(tuple((v, h) for _, v, h in kept))
