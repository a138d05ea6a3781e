"""What each runtime hook relies on in vLLM's code, checked by source text.

A hook wraps vLLM methods and counts on a few lines inside them (the call whose
result it replaces, the bookkeeping it repeats). A vLLM release that moves one of
them must leave the hook off with a line saying so, never run it on code it does not
know: every hook module lists its points here as ``(module:Attr.path, text)``, text
None for "the attribute exists" or a tuple of texts any one of which will do (a line
that differs by release: ``texts``), and checks them at install (``missing``);
``commfold doctor`` and tools/vllm_compat.py read the same lists.
"""
from __future__ import annotations

import functools
import inspect

def resolve(where: str):
    """The object named 'module:Attr.path' (raises if it is not there)."""
    import importlib

    module, _, attr = where.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def texts(text) -> tuple[str, ...]:
    """A point's text as its alternatives."""
    return (text,) if isinstance(text, str) else tuple(text)


def missing(points) -> list[str]:
    """The points this vLLM no longer has, as 'where: text' or 'where (Error)'."""
    return [m for where, text in points if (m := _missing(where, text)) is not None]


@functools.cache  # vLLM's code does not change within a process
def _missing(where: str, text: str | None) -> str | None:
    try:
        obj = resolve(where)
        obj = _kernel_function(obj)
        # commfold's own wrappers (comm log, target pick, draft pick) wrap the original
        source = inspect.getsource(inspect.unwrap(obj)) if text is not None else ""
    except Exception as e:  # moved, renamed, no source
        return f"{where} ({type(e).__name__})"
    if text is not None and not any(t in source for t in texts(text)):
        return f"{where}: {' / '.join(t.splitlines()[0].strip() for t in texts(text))}"
    return None


def _kernel_function(obj):
    """A Triton kernel's Python function (JITFunction / InterpretedFunction.fn)."""
    fn = getattr(obj, "fn", None)
    if inspect.isfunction(fn) and not (inspect.isroutine(obj) or inspect.isclass(obj)):
        return fn
    return obj
