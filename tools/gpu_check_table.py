"""The GPU check's one table: the rows tests/gpu wrote (JSON lines: check, result,
numbers) as markdown, with a row for a pytest run that ended without reporting
(a timeout, a crash before the first test).

    python tools/gpu_check_table.py ROWS.jsonl --status N [--limit S] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

TIMED_OUT = (124, 137)  # timeout(1)'s status, and SIGKILL's after its grace period


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def table(rows: list[dict], status: int, limit: float | None) -> str:
    rows = list(rows)
    if status in TIMED_OUT:
        rows.append({"check": "gpu check", "numbers": "",
                     "result": f"FAILED: timed out after {limit:.0f} s (the rows above "
                               "finished; the rest did not report)"})
    elif status not in (0, 1):
        rows.append({"check": "gpu check", "numbers": "",
                     "result": f"FAILED: pytest exit status {status} (see its output)"})
    lines = ["| check | result | numbers |", "|---|---|---|"]
    lines += [f"| {cell(r['check'])} | {cell(r['result'])} | {cell(r['numbers'])} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", type=Path, help="the JSON-lines file the tests wrote")
    p.add_argument("--status", type=int, required=True, help="pytest's exit status")
    p.add_argument("--limit", type=float, default=None, help="the time limit, in seconds")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    text = table(read_rows(args.rows), args.status, args.limit)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
