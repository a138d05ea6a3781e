"""Patch a module as it is first imported (tests only): test stand-ins registered in
every process an engine starts (a sitecustomize calls them) before anything imports
vLLM, without importing it early themselves."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch: Callable[[ModuleType], None]):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched(module, patch=self.patch):
            exec_module(module)
            patch(module)
        spec.loader.exec_module = patched
        return spec


def after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` once module `name` has executed on its first import here
    (at once when it is already imported)."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, patch))
