"""Post-grad graphs as text for the dumps: readable Python, and unified diffs."""
from __future__ import annotations

import difflib
import re

_DEAD_VARS = re.compile(r";\s+[\w\s=]+= None$")


def render(graph) -> str:
    """A post-grad graph as readable Python: typed, one op per line, each block
    headed by the user source line (file, line, code) that produced it."""
    src = graph.python_code(root_module="self", verbose=True).src
    lines = [_DEAD_VARS.sub("", line.rstrip()) for line in src.strip("\n").splitlines()]
    return "\n".join(lines) + "\n"


def unified(before: str, after: str, name: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        f"{name}.before.py", f"{name}.after.py", n=3))
