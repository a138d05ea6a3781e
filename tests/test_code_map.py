"""docs/CODE_MAP.md names every module of the package: a module added without a line
in the map fails here, so the map stays the place to start reading. A module counts as
named by its name in backticks (`decision`, or a dotted tail of it:
`target.decision`), its file name (decision.py) or its path (commfold/vllm/target/
decision.py, target/decision.py), in or out of backticks. Package ``__init__`` modules
are named by their folder's row."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_MAP = ROOT / "docs" / "CODE_MAP.md"
# source folder -> package name (pyproject's package-dir)
PACKAGES = {"commfold": "commfold", "passes": "commfold.passes",
            "patterns": "commfold.patterns"}


def modules() -> dict[tuple[str, ...], Path]:
    """Every module of the installed package but ``__init__``, as its dotted parts."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts or path.name == "__init__.py":
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            out[(*package.split("."), *parts)] = path
    return out


def named(text: str) -> set[tuple[str, ...]]:
    """What the map names, each as dotted parts: every backticked span, and every word
    out of backticks ending in .py (a file name or a path)."""
    spans = re.findall(r"`([^`\n]+)`", text)
    files = re.findall(r"(?<![\w./-])([\w./-]*\w\.py)\b", re.sub(r"`[^`\n]*`", " ", text))
    out = set()
    for name in (*spans, *files):
        name = name.strip().removesuffix(".py").replace("/", ".").strip(".")
        if re.fullmatch(r"\w+(\.\w+)*", name):
            out.add(tuple(name.split(".")))
    return out


def unnamed(text: str, found: dict[tuple[str, ...], Path]) -> list[str]:
    names = named(text)
    return [str(path.relative_to(ROOT)) for parts, path in found.items()
            if not any(parts[-len(n):] == n for n in names)]


def test_every_module_is_in_the_code_map():
    found = modules()
    # sub-packages walked: a glob of the top level alone would check a fraction
    deep = {("commfold", "vllm", "target", "decision"), ("commfold", "cli", "diff", "rank"),
            ("commfold", "passes", "local_argmax"), ("commfold", "patterns", "common")}
    assert deep <= set(found)
    missing = unnamed(CODE_MAP.read_text(), found)
    assert not missing, f"modules docs/CODE_MAP.md does not name: {missing}"


def test_a_module_counts_only_when_the_map_names_it():
    found = {("commfold", "vllm", "target", "decision"): ROOT / "commfold/vllm/target/decision.py",
             ("commfold", "passes", "local_topk"): ROOT / "passes/local_topk.py"}
    assert unnamed("`target.decision` and passes/local_topk.py", found) == []
    assert unnamed("`decision`, `local_topk.py`", found) == []
    assert unnamed("commfold/vllm/target/decision.py; local_topk.py", found) == []
    # another module's dotted name, a word inside another name, a prose mention
    assert unnamed("`sample.decision`, my_local_topk.py, the decision", found) == [
        "commfold/vllm/target/decision.py", "passes/local_topk.py"]
