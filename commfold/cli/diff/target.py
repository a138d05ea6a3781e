"""What `commfold diff` runs: a script path or module:function, checked before any
rank starts."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from commfold.cli.diff.errors import EXIT_BAD_INPUT, DiffError


@dataclasses.dataclass(frozen=True)
class Target:
    """A script path (run as __main__) or module:function (called on each rank)."""

    script: str | None = None
    module: str | None = None
    function: str | None = None

    @classmethod
    def parse(cls, text: str) -> Target:
        if text.endswith(".py") or os.sep in text or os.path.exists(text):
            path = Path(text)
            if not path.is_file():
                raise DiffError(f"no such script: {text}", EXIT_BAD_INPUT)
            return cls(script=str(path.resolve()))
        module, sep, function = text.partition(":")
        if not sep or not module or not function:
            raise DiffError(f"target {text!r} is neither an existing .py file nor "
                            "module:function", EXIT_BAD_INPUT)
        import importlib.util

        sys.path.insert(0, os.getcwd())  # as in the ranks: modules beside the cwd import
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as e:
            spec, why = None, f" ({e})"
        else:
            why = ""
        finally:
            sys.path.pop(0)
        if spec is None:
            raise DiffError(f"no module named {module!r}{why}", EXIT_BAD_INPUT)
        return cls(module=module, function=function)

    def __str__(self) -> str:
        return self.script or f"{self.module}:{self.function}"
