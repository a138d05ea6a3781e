"""tools/gpu_pick_time.py (the GPU estimate's compute side) run on CPU with
--cpu-dry-run: every (vocab, TP, rows, pick) row present once, the table's cells
in the header's order, the JSON the same rows, and the shard widths vLLM's."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_pick_time",
                                                  ROOT / "tools" / "gpu_pick_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_writes_one_row_per_case(tmp_path, capsys):
    tool = _tool()
    assert tool.main(["--cpu-dry-run", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "gpu_pick_time.md").read_text().splitlines()
    assert md[0].startswith("device: cpu (dry run)")
    head = md[2:4]
    assert head[0] == "| " + " | ".join(tool.HEADER) + " |"
    lines = md[4:]
    cases = {(w, r, p) for w in tool.WORLDS for r in tool.ROWS for p in tool.PICKS}
    assert len(lines) == len(cases)
    got = set()
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(tool.HEADER), line
        assert cells[:2] == ["tiny", "1000"] and cells[7].endswith("x")
        assert float(cells[5]) > 0 and float(cells[6]) > 0
        got.add((int(cells[2]), int(cells[3]), cells[4]))
    assert got == cases
    rows = json.loads((tmp_path / "gpu_pick_time.json").read_text())["rows"]
    assert len(rows) == len(cases) and "gpu pick time" not in capsys.readouterr().out


def test_shard_widths_are_vllms():
    tool = _tool()
    assert [tool.shard_width(151936, w) for w in (2, 4, 8)] == [75968, 37984, 18992]
    assert [tool.shard_width(128256, w) for w in (2, 4, 8)] == [64128, 32064, 16032]
