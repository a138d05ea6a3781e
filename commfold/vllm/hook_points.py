"""What each runtime hook relies on in vLLM's code, checked by source.

A hook wraps vLLM methods and counts on a few lines inside them (the call whose
result it replaces, the bookkeeping it repeats). A vLLM release that moves one of
them must leave the hook off with a line saying so, never run it on code it does not
know: every hook module lists its points here as ``(module:Attr.path, text)``, text
None for "the attribute exists" or a tuple of texts any one of which will do (a line
that differs by release: ``texts``), and checks them at install (``missing``);
``commfold doctor`` and tools/vllm_compat.py read the same lists.

A text point catches a line that moved, not one vLLM added. Where a hook stands in
for a function's whole body (it returns what that function would), the point is
``Pinned``: the hash of the function's whole source, one per release it was checked
against, so any change to that function turns the hook off until it is read again.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Pinned:
    """A function's whole source, by hash (``source_hash``), per vLLM release."""
    hashes: tuple[tuple[str, str], ...]  # (release, hash)

    def releases(self) -> str:
        return ", ".join(release for release, _ in self.hashes)

    def holds(self, source: str) -> bool:
        return source_hash(source) in {h for _, h in self.hashes}


def source_hash(source: str) -> str:
    """A function's source, from its ``def`` line (decorators and indentation left
    out, trailing blanks stripped), hashed: the same from inspect.getsource and from
    a statically parsed file (tools/vllm_compat.py)."""
    lines = textwrap.dedent(source).strip("\n").splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith(("def ", "async def "))), 0)
    text = "\n".join(line.rstrip() for line in lines[start:])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe(text) -> str:
    """How a point's text reads in a line or a table."""
    if isinstance(text, Pinned):
        return f"whole source pinned ({text.releases()})"
    return " / ".join(t.splitlines()[0].strip() for t in texts(text))


def wrap(owner, name: str, make, mark: str) -> None:
    """owner.name = make(original), once (the wrapper carries `mark` and the original
    as __wrapped__, which ``missing`` and ``unwrap`` follow)."""
    original = getattr(owner, name)
    if getattr(original, mark, False):
        return
    wrapped = make(original)
    wrapped.__wrapped__, wrapped.__name__ = original, name
    setattr(wrapped, mark, True)
    setattr(owner, name, wrapped)


def unwrap(owner, name: str, mark: str) -> None:
    """Undo ``wrap`` (tests)."""
    current = getattr(owner, name)
    if getattr(current, mark, False):
        setattr(owner, name, current.__wrapped__)


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
def _missing(where: str, text) -> str | None:
    try:
        obj = resolve(where)
        obj = _kernel_function(obj)
        # commfold's own wrappers (comm log, target pick, draft pick) wrap the original
        source = inspect.getsource(inspect.unwrap(obj)) if text is not None else ""
    except Exception as e:  # moved, renamed, no source
        return f"{where} ({type(e).__name__})"
    if isinstance(text, Pinned):
        if not text.holds(source):
            return (f"{where} changed (source hash {source_hash(source)}; read for "
                    f"{text.releases()})")
        return None
    if text is not None and not any(t in source for t in texts(text)):
        return f"{where}: {describe(text)}"
    return None


def _kernel_function(obj):
    """A Triton kernel's Python function (JITFunction / InterpretedFunction.fn)."""
    fn = getattr(obj, "fn", None)
    if inspect.isfunction(fn) and not (inspect.isroutine(obj) or inspect.isclass(obj)):
        return fn
    return obj
