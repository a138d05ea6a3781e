"""Every reason a recognizer in patterns/ can give for a near-miss is asserted by a
recognizer test (tests/test_recognize_*.py): a new Miss reason without a test fails
here. Reasons are read from the source (the texts given to Miss, or returned as a
reason by a helper); a test asserts the full reason text, which must match the
template (f-string holes match anything)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# functions that return a reason (text) a caller wraps in a Miss
REASON_HELPERS = {"monotone_step", "_pick_problem", "_leaf", "_served_ranges", "_near", "_miss",
                  "_why"}


def _texts(node) -> list[ast.AST]:
    """The string constants and f-strings an expression can evaluate to."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, ast.JoinedStr):
        return [node]
    if isinstance(node, ast.BoolOp):
        return [t for v in node.values for t in _texts(v)]
    if isinstance(node, ast.IfExp):
        return _texts(node.body) + _texts(node.orelse)
    if isinstance(node, ast.Tuple):
        return [t for v in node.elts for t in _texts(v)]
    return []


def _template(node) -> str:
    """A regex for the texts node gives: constant parts literal, holes anything."""
    if isinstance(node, ast.Constant):
        return re.escape(node.value)
    return "".join(re.escape(v.value) if isinstance(v, ast.Constant) else ".+"
                   for v in node.values)


def reason_templates() -> dict[str, str]:
    """{regex: 'file:line'} of every reason text in patterns/."""
    found = {}
    for path in sorted((ROOT / "patterns").glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                texts = []
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                        "Miss", "_near", "_miss"):
                    texts = [t for a in node.args for t in _texts(a)]
                elif isinstance(node, ast.Return) and fn.name in REASON_HELPERS \
                        and node.value is not None:
                    texts = _texts(node.value)
                for t in texts:
                    text = _template(t)
                    if not re.fullmatch(r"[\w.]+", text):  # a reason, not an op name
                        found[text] = f"{path.name}:{t.lineno}"
    return found


def asserted_texts() -> set[str]:
    """Every string constant in the recognizer tests."""
    out = set()
    for path in (ROOT / "tests").glob("test_recognize_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return out


def test_reasons_are_found():
    templates = reason_templates()
    assert len(templates) > 80, len(templates)  # the extraction itself works
    assert any(re.fullmatch(t, "argmax over torch.int64 logits (floating point only)")
               for t in templates)


def test_every_miss_reason_is_asserted():
    texts = asserted_texts()
    missing = [f"{where}: {pattern}" for pattern, where in reason_templates().items()
               if not any(re.fullmatch(pattern, t) for t in texts)]
    assert not missing, "no recognizer test asserts these reasons:\n" + "\n".join(missing)


# ---- the fused norm's near-misses say why -------------------------------------------

# the recognizers of the all-reduce + RMSNorm fusion, and its pass
FUSE_PATH = ("allreduce.py", "rmsnorm.py", "rmsnorm_vllm.py", "norm_reach.py",
             "residual_scale.py", "broadcast.py", "vendor_fused.py")
# the property a reason names: shape, dtype, another consumer, group, reduce op, or
# where the op sits (order): one of these words in each
PROPERTIES = {
    "shape": r"shape|dims?\b|\\\[|vector|view|broadcast|repeated|row",
    "dtype": r"dtype|float32|f32|torch\\\.",
    "consumer": r"read|getitem",
    "group": r"group|handle",
    "reduce op": r"only\\ a\\ sum|'\.\+'",
    "order": r"followed|between|after|before|without|once|twice|second|spelling|number|scale",
}


# a guard no program built in a test reaches: a reader of the norm's result placed
# before one of the fused op's operands (FX graphs in traced order never hold one)
NOT_BUILT = {re.escape("the norm's operands are defined after readers of its result")}


def _passes_reasons() -> dict[str, str]:
    """{regex: 'file:line'} of the reasons fuse_allreduce_rmsnorm's _unsafe returns."""
    path = ROOT / "passes" / "fuse_allreduce_rmsnorm.py"
    found = {}
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, ast.FunctionDef) and fn.name == "_unsafe":
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
                    for t in _texts(node.value.elts[-1]):
                        found[_template(t)] = f"{path.name}:{t.lineno}"
    return found


def test_every_miss_is_attached_to_a_node():
    """A near-miss names its node: the report's location and source line are the node's."""
    unplaced = []
    for path in sorted((ROOT / "patterns").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Miss" \
                    and len(node.args) < 2 and not any(k.arg == "node" for k in node.keywords):
                unplaced.append(f"{path.name}:{node.lineno}")
    assert not unplaced, f"Miss without its node: {unplaced}"


def test_fused_norm_reasons_name_the_property_that_failed():
    reasons = {t: w for t, w in reason_templates().items() if w.split(":")[0] in FUSE_PATH}
    unsafe = _passes_reasons()
    assert len(reasons) > 30 and len(unsafe) >= 4, (len(reasons), unsafe)
    vague = [f"{w}: {t}" for t, w in {**reasons, **unsafe}.items()
             if not any(re.search(p, t) for p in PROPERTIES.values())]
    assert not vague, "reasons that name no property (shape, dtype, reader, group, " \
        "reduce op, order):\n" + "\n".join(vague)
    # the pass's own reasons are asserted by a fusion test, as the recognizers' are
    texts = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.add(node.value)
    untested = [f"{w}: {t}" for t, w in unsafe.items() if t not in NOT_BUILT
                and not any(re.fullmatch(t, s) for s in texts)]
    assert not untested, "no test asserts these reasons:\n" + "\n".join(untested)
