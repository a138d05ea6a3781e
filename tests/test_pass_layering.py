"""Passes stand alone: no pass module imports another (pieces several passes share
live in passes/_*.py), and graph-wide normal forms are the manager's canonicalization
(commfold.canonicalize), which no pass calls; patterns/ only recognizes (no graph
edit)."""
from __future__ import annotations

import ast
from pathlib import Path

import commfold

ROOT = Path(__file__).resolve().parent.parent
EDITS = ("erase_node", "replace_all_uses_with", "erase_if_dead", "insert_call",
         "inserting_before", "inserting_after", "call_function")


def _imports(path: Path) -> list[str]:
    """Every module path a file imports, relative ones spelled from passes/."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = "commfold.passes" + (f".{base}" if base else "")
            found += [base] + [f"{base}.{a.name}" for a in node.names]
    return found


def test_no_pass_imports_another_pass_or_canonicalizes():
    bad = []
    for name in commfold.ALL_PASSES:
        others = {f"{pkg}.{p}" for p in commfold.ALL_PASSES if p != name
                  for pkg in ("commfold.passes", "passes")}
        for mod in _imports(ROOT / "passes" / f"{name}.py"):
            if mod in others or mod.startswith("commfold.canonicalize") \
                    or mod.endswith("fold_readbacks"):
                bad.append((name, mod))
    assert bad == []


def test_patterns_do_not_edit_graphs():
    bad = [(p.name, n.attr) for p in sorted((ROOT / "patterns").glob("*.py"))
           for n in ast.walk(ast.parse(p.read_text()))
           if isinstance(n, ast.Attribute) and n.attr in EDITS]
    bad += [(p.name, mod) for p in sorted((ROOT / "patterns").glob("*.py"))
            for mod in _imports(p) if mod.endswith(EDITS)]
    assert bad == []
