"""The README's performance table quotes its figures from machine-readable results files
(benchmarks/results/*.json, written by `python -m benchmarks` and
`python -m benchmarks.bench_vllm_engine`): every number in it must equal the file the
row cites, up to rounding to the printed digits.

A row of the table is `| figure | plain → commfold | speed-up | source |`:
- source: a link to the results file, then the record in it in backticks: a figure of
  results.json (`local_argmax`, `sampling`, `allreduce_rmsnorm`, `replicate`,
  `decode`), a spec-decoding method of vllm_engine.json (`none`, `draft_model`,
  `eagle3`), a traffic kind of traffic_bytes.json (`greedy`, `chat-top-p`, ...), a
  shape of vllm_shapes.json (`llama-3.2-1b`), or a request rate of vllm_serve.json (`inf`);
- figure: the row's parameters as the results file names them (B=, V=, T=, H=, r=,
  C=, TP=; TP=2 unless given), plus the words that pick a case (f32 / bf16 / fp16,
  top-k / logprob, embedding / head), and for a replicated layer its full weight
  "(N MiB)";
- plain → commfold: two numbers and a unit (ms, tok/s, or B for collective bytes);
- speed-up: plain / commfold (tok/s: commfold / plain; the fused norm: the median of
  its paired rounds, as results.md prints it), or "–".

Reads text and JSON only (no torch, no vLLM)."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/"
REGENERATE = "python -m benchmarks"
NUMBER = r"\d[\d,]*(?:\.\d+)?"
DTYPES = {"f32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}


@functools.cache
def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def performance_table(readme: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """(header cells, [(line number, cells)]) of the table in the README's Performance
    section with a "source" column."""
    lines = readme.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("## Performance")), None)
    assert start is not None, "README.md has no '## Performance' section"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
               len(lines))
    tables, current = [], []
    for i in range(start + 1, end):
        if lines[i].startswith("|"):
            current.append((i + 1, [c.strip() for c in lines[i].strip().strip("|").split("|")]))
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    sourced = [t for t in tables if "source" in [c.lower() for c in t[0][1]]]
    assert len(sourced) == 1, f"expected one table with a 'source' column, found {len(sourced)}"
    (_, header), _separator, *rows = sourced[0]
    assert rows, "the performance table has no rows"
    return header, rows


def _number(text: str) -> tuple[float, float]:
    """(value, tolerance): half a unit in the last printed digit."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text.replace(",", "")), 0.5 * 10.0 ** -decimals * (1 + 1e-9) + 1e-12


def _label_params(label: str) -> dict:
    p = {k: int(v) for k, v in re.findall(r"\b(B|V|T|H|r|C|TP)=(\d+)\b", label)}
    words = re.findall(r"[A-Za-z0-9+-]+", label)
    dtypes = {DTYPES[w] for w in words if w in DTYPES}
    if dtypes:
        assert len(dtypes) == 1, f"more than one dtype in {label!r}"
        p["dtype"] = dtypes.pop()
    top = re.search(r"\btop-(\d+)\b", label)
    if "logprob" in label:
        p["case"] = "greedy+logprob"
    elif top:
        p["case"] = f"top-{top.group(1)}"
    if "embedding" in label:
        p["layer"] = "embedding"
    elif re.search(r"\bhead\b", label):
        p["layer"] = "head"
    return p


def _suite_figure(data: dict, name: str, label: str, unit: str) -> dict:
    """plain / commfold / ratio of the one row of results.json's figure `name` that the
    label's parameters pick."""
    figures = data.get("figures", {})
    assert name in figures, f"{name!r} is not a figure of results.json ({sorted(figures)})"
    p = _label_params(label)
    want = {"world": p.pop("TP", 2), **p}
    rows = [r for r in figures[name]["rows"]
            if all(r[k] == v for k, v in want.items() if k in r)]
    unused = [k for k in want if not any(k in r for r in figures[name]["rows"])]
    assert not unused, f"{label!r}: {unused} are not fields of {name}'s rows"
    assert len(rows) == 1, f"{label!r} picks {len(rows)} rows of {name} ({want}), not one"
    r = rows[0]
    base, new = r["baseline"], r["rewritten"]
    if unit == "ms":
        plain, mine = r[f"{base}_s"] * 1e3, r[f"{new}_s"] * 1e3
    elif unit == "tok/s":
        plain, mine = r[f"{base}_tok_s"], r[f"{new}_tok_s"]
    elif unit == "B":
        plain, mine = r["comm"][base]["bytes"], r["comm"][new]["bytes"]
    else:
        raise AssertionError(f"{label!r}: unit {unit!r} is not one of ms, tok/s, B")
    ratio = (r["ratio"][new]["median"] if "ratio" in r
             else r[f"{base}_s"] / r[f"{new}_s"])
    return {"plain": plain, "commfold": mine, "ratio": ratio, "MiB": r.get("full_mib")}


def _engine_figure(data: dict, method: str, label: str, unit: str) -> dict:
    """vLLM as shipped vs commfold in vllm_engine.json: tokens/s at concurrency C, or
    collective bytes per step per rank (the target's pick: logits + sampling phases;
    the drafting loop; else every phase)."""
    runs = data.get("runs", {})
    pair = [runs.get(f"{method}/{v}") for v in ("vllm", "commfold")]
    assert all(pair), f"vllm_engine.json has no {method}/vllm and {method}/commfold runs"
    if unit == "tok/s":
        c = _label_params(label).get("C")
        assert c is not None, f"{label!r}: an engine row names its concurrency (C=)"
        plain, mine = (next((x["tokens_per_s"] for x in run["rows"] if x["concurrency"] == c),
                            None) for run in pair)
        assert plain is not None and mine is not None, f"{method}: no rows at C={c}"
        return {"plain": plain, "commfold": mine, "ratio": mine / plain}
    if unit == "B":
        phases = (("logits", "sampling") if "pick" in label
                  else ("drafting",) if "draft" in label else None)
        plain, mine = (run["comm"]["bytes_per_step"] if phases is None
                       else sum(run["comm"]["by_phase"][ph] for ph in phases) for run in pair)
        return {"plain": plain, "commfold": mine, "ratio": plain / mine if mine else None}
    raise AssertionError(f"{label!r}: unit {unit!r} is not one of tok/s, B")


def _traffic_figure(data: dict, kind: str, label: str, unit: str) -> dict:
    """traffic_bytes.json: bytes per decode step per rank of one traffic kind, vLLM's
    gather vs commfold, at the label's C=, TP= (2 unless given) and V=."""
    assert unit == "B", f"{label!r}: traffic rows are bytes (B), not {unit!r}"
    p = _label_params(label)
    want = {"kind": kind, "C": p.get("C"), "TP": p.get("TP", 2), "vocab": p.get("V")}
    assert want["C"] and want["vocab"], f"{label!r}: a traffic row names C= and V="
    rows = [r for r in data.get("rows", []) if all(r[k] == v for k, v in want.items())]
    assert rows, f"{label!r}: no row of traffic_bytes.json is {want}"
    plain, mine = rows[0]["gather"], rows[0]["commfold"]
    assert all((r["gather"], r["commfold"]) == (plain, mine) for r in rows), want
    return {"plain": plain, "commfold": mine, "ratio": plain / mine if mine else None}


def _shape_figure(data: dict, shape: str, label: str, unit: str) -> dict:
    """vLLM vs commfold at a real model's shape in vllm_shapes.json: tokens/s at C=,
    greedy or logprobs=5 traffic ("logprob" in the label); the ratio is the file's
    median of per-round ratios."""
    assert unit == "tok/s", f"{label!r}: a shape row is in tok/s"
    rows = data.get("shapes", {}).get(shape, {}).get("rows", [])
    c = _label_params(label).get("C")
    traffic = "logprobs=5" if "logprob" in label else "greedy"
    pick = {r["variant"]: r for r in rows if r["concurrency"] == c and r["traffic"] == traffic}
    assert {"vllm", "commfold"} <= set(pick), f"{shape}: no {traffic} rows at C={c}"
    return {"plain": pick["vllm"]["tokens_per_s"], "commfold": pick["commfold"]["tokens_per_s"],
            "ratio": pick["commfold"]["vs_vllm"]}


def _serve_figure(data: dict, rate: str, label: str, unit: str) -> dict:
    """vLLM's server vs commfold's in vllm_serve.json at request rate `rate`, as `vllm
    bench serve` measured them: median TPOT (ms; the ratio: the file's median of
    per-round vLLM / commfold) or output tok/s."""
    pick = {r["variant"]: r for r in data.get("rows", []) if r["rate"] == rate}
    assert {"vllm", "commfold"} <= set(pick), f"vllm_serve.json: no rows at rate {rate}"
    if unit == "ms":
        key, ratio = "median_tpot_ms", pick["commfold"]["tpot_speedup"]
    elif unit == "tok/s":
        key, ratio = "output_throughput", pick["commfold"]["throughput_vs_vllm"]
    else:
        raise AssertionError(f"{label!r}: unit {unit!r} is not one of ms, tok/s")
    return {"plain": pick["vllm"][key], "commfold": pick["commfold"][key], "ratio": ratio}


READERS = {"results.json": _suite_figure, "vllm_engine.json": _engine_figure,
           "vllm_shapes.json": _shape_figure, "vllm_serve.json": _serve_figure,
           "traffic_bytes.json": _traffic_figure}


def check(readme: str, root: Path = ROOT, only_line: int | None = None) -> list[str]:
    """Every disagreement between the README's performance table and the files it cites
    (only_line: the row on that line of the README only)."""
    header, rows = performance_table(readme)
    cols = [c.lower() for c in header]
    i_values = next((i for i, c in enumerate(cols) if "→" in c), None)
    i_ratio = next((i for i, c in enumerate(cols) if "speed-up" in c or "ratio" in c), None)
    i_source = cols.index("source")
    assert i_values is not None and i_ratio is not None, f"unexpected header {header}"
    problems = []
    for line, cells in rows:
        if only_line is not None and line != only_line:
            continue
        label, values, ratio_cell, source = (cells[0], cells[i_values], cells[i_ratio],
                                             cells[i_source])
        where = f"README.md:{line} ({label})"
        link = re.search(r"\]\(([^)]+)\)", source)
        record = re.search(r"\)\s*:?\s*`([^`]+)`", source)
        if not link or not record:
            problems.append(f"{where}: the source cell needs a link and a `record`: {source!r}")
            continue
        path = link.group(1)
        if not path.startswith(RESULTS) or not path.endswith(".json"):
            problems.append(f"{where}: {path} is not a machine-readable file in {RESULTS}")
            continue
        if not (root / path).is_file():
            problems.append(f"{where}: {path} does not exist")
            continue
        m = re.fullmatch(rf"({NUMBER})\s*→\s*({NUMBER})\s*(ms|tok/s|B)", values)
        if not m:
            problems.append(f"{where}: cannot read {values!r} as 'A → B unit'")
            continue
        unit = m.group(3)
        data = _load(root / path)
        try:
            reader = READERS.get(Path(path).name)
            if reader is None:
                raise AssertionError(f"no reader for {path}")
            truth = reader(data, record.group(1), label, unit)
        except (AssertionError, KeyError) as e:
            problems.append(f"{where}: {e}")
            continue
        quoted = {"plain": m.group(1), "commfold": m.group(2)}
        mib = re.search(rf"\(({NUMBER}) MiB\)", label)  # a replicated layer's full weight
        if mib:
            quoted["MiB"] = mib.group(1)
        if ratio_cell not in ("–", "-", ""):
            r = re.fullmatch(rf"({NUMBER})\s*[x×]", ratio_cell)
            if not r:
                problems.append(f"{where}: cannot read the ratio {ratio_cell!r}")
                continue
            quoted["ratio"] = r.group(1)
        for key, text in quoted.items():
            value, tol = _number(text)
            actual = truth.get(key)
            if actual is None or abs(value - actual) > tol:
                problems.append(f"{where}: {key} {text} but {path} (`{record.group(1)}`) "
                                f"gives {actual!r}")
    return problems


def test_readme_figures_equal_their_results_files():
    problems = check((ROOT / "README.md").read_text())
    assert not problems, "\n".join(problems)


def test_readme_names_the_command_that_regenerates_the_results():
    section = (ROOT / "README.md").read_text().split("## Performance", 1)[1].split("\n## ")[0]
    assert REGENERATE in section
    suite = (ROOT / "benchmarks" / "suite.py").read_text()
    assert 'DEFAULT_OUT = Path(__file__).resolve().parent / "results"' in suite


def test_every_quoted_figure_is_checked():
    """The checker is not vacuous: moving any number of the table by five units in its
    last printed digit, or citing another results file, is a failure naming that row."""
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    _, rows = performance_table(readme)
    mutations = 0
    for line, cells in rows:
        text = lines[line - 1]
        # the value and ratio columns, and a weight in MiB in the label
        quoted = cells[1:-1] + re.findall(r"\(\d+ MiB\)", cells[0])
        for cell in quoted:
            for num in re.finditer(NUMBER, cell):
                digits = num.group(0)
                bumped = digits[:-1] + str((int(digits[-1]) + 5) % 10)
                start = text.index(cell) + num.start()
                changed = text[:start] + bumped + text[start + len(digits):]
                mutated = "\n".join(lines[:line - 1] + [changed] + lines[line:])
                problems = check(mutated, only_line=line)
                assert any(p.startswith(f"README.md:{line} ") for p in problems), (
                    f"changing {digits} to {bumped} in line {line} went unnoticed")
                mutations += 1
        other = ("vllm_engine.json" if "results.json" in cells[-1] else "results.json")
        swapped = re.sub(r"\(benchmarks/results/[^)]+\)", f"({RESULTS}{other})", text, count=1)
        mutated = "\n".join(lines[:line - 1] + [swapped] + lines[line:])
        assert any(p.startswith(f"README.md:{line} ")
                   for p in check(mutated, only_line=line)), (
            f"citing {other} in line {line} went unnoticed")
    assert mutations >= 2 * len(rows)
