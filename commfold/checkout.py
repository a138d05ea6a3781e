"""commfold run from a source checkout without installing it (``PYTHONPATH=.``, as
tools/gpu_check.sh runs it on a GPU machine): passes/ and patterns/ sit beside the
package there, where an install puts them inside it as commfold.passes and
commfold.patterns (pyproject's package-dir). A finder at the end of sys.meta_path gives
them those names; an installed commfold, which has them, never adds it. The finder goes
first: an editable install of another checkout (setuptools' finder, also on
sys.meta_path) would otherwise answer for them with that checkout's folders."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
SUBPACKAGES = ("passes", "patterns")


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        sub = name.partition("commfold.")[2]
        if not name.startswith("commfold.") or sub not in SUBPACKAGES:
            return None
        folder = _PACKAGE.parent / sub
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)])


def install() -> None:
    """Add the finder when this commfold/ is a checkout's (passes/ beside it, not in it);
    once per process."""
    if (_PACKAGE / "passes").exists() or not (_PACKAGE.parent / "passes" / "__init__.py").exists():
        return
    if not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder())
