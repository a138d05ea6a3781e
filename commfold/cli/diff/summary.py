"""The table `commfold diff` prints and writes to summary.txt: rank 0's decisions per
graph, the near-misses, and whether every rank decided the same."""
from __future__ import annotations

import json
from pathlib import Path

from commfold.report import Comm, code_lines, format_bytes


def load_reports(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def _fmt_comm(c: dict) -> str:
    return str(Comm(c["bytes"], c["calls"]))


def summary(graphs_per_rank: list[list[dict]], out_dir: Path) -> str:
    """The table users read: rank 0's decisions, per graph, plus whether every rank
    decided the same (a mismatch would be a collective mismatch: a hang)."""
    graphs = graphs_per_rank[0]
    rows = [("graph", "pass", "pattern", "source", "comm/call before -> after", "extra mem")]
    misses, errors = [], []
    for g in graphs:
        for r in g["rewrites"]:
            rows.append((str(g["graph"]), r["pass_name"], r["pattern"], r["location"],
                         f"{_fmt_comm(r['comm_before'])} -> {_fmt_comm(r['comm_after'])}",
                         format_bytes(r["extra_memory_bytes"])))
        misses += [(g["graph"], m) for m in g["near_misses"]]
        errors += [(g["graph"], e) for e in g["errors"]]
    n_rewrites = len(rows) - 1
    lines = [f"commfold diff: {len(graphs)} graph(s) compiled, {n_rewrites} rewrite(s), "
             f"{len(misses)} near-miss(es), {len(errors)} pass error(s) (rank 0)"]
    if n_rewrites:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  " + " | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                  for row in rows]
    else:
        lines.append("  no rewrites")
    if misses:
        lines.append("near-misses:")
        for g, m in misses:  # the reason, then the user's line it points at
            lines.append(f"  graph {g} [{m['pass_name']}/{m['pattern']}] at {m['location']}: "
                         f"{m['reason']}")
            lines += code_lines(m.get("code", ""))
    for g, e in errors:
        first = (e["error"].splitlines() or [""])[0][:200]
        lines.append(f"  ERROR graph {g} in {e['pass_name']}: {first} (graph left unchanged by it)")
    prints = [[g["fingerprint"] for g in gs] for gs in graphs_per_rank]
    if all(p == prints[0] for p in prints):
        lines.append(f"ranks: all {len(prints)} decided the same on every graph")
    else:
        bad = [r for r, p in enumerate(prints) if p != prints[0]]
        lines.append(f"WARNING: rank(s) {bad} decided differently from rank 0 "
                     "(a collective mismatch: report it as a commfold bug)")
    lines.append(f"dumps: {out_dir}/rank<r>/graph<g>/NN_<pass>.{{before.py,after.py,diff}}, "
                 f"rank<r>/depyf/ (decompiled dynamo code), rank<r>/log.txt")
    return "\n".join(lines)
