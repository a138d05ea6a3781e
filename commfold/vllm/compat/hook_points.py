"""What each runtime hook relies on in vLLM's code, checked by source.

A hook wraps vLLM methods and counts on a few lines inside them (the call whose
result it replaces, the bookkeeping it repeats). A vLLM release that moves one of
them must leave the hook off with a line saying so, never run it on code it does not
know: every hook module lists its points here as ``(module:Attr.path, text)``, text
None for "the attribute exists" or a tuple of texts any one of which will do (a line
that differs by release: ``texts``), and checks them at install (``missing``);
``commfold doctor`` and tools/vllm_compat.py read the same lists (through the registry,
commfold.vllm.compat.hooks).

A text point catches a line that moved, not one vLLM added. Where a hook stands in
for a function's whole body (it returns what that function would), the point is
``Pinned``: the hash of the function's whole source, one per release it was checked
against (from the generated table, commfold.vllm.compat.pins), so any change to that
function turns the hook off until it is read again.

Every hook changes vLLM's code one way, ``wrap``: a wrapper that calls the original,
marked with the hook's name (MARK) and holding the original as ``__wrapped__``; a
class's or module's wraps are recorded, so ``unwrap_hook`` (each hook's uninstall)
puts vLLM's own functions back.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import textwrap
import types
from dataclasses import dataclass

from commfold.vllm.compat import releases


@dataclass(frozen=True)
class Pinned:
    """A function's whole source, by hash (``source_hash``), per vLLM release."""
    hashes: tuple[tuple[str, str], ...]  # (release, hash)

    def releases(self) -> str:
        return ", ".join(release for release, _ in self.hashes)

    def holds(self, source: str, release: str) -> bool:
        """Whether `source` is the function as claimed release `release` has it."""
        return self.holds_for(source_hash(source), release)

    def holds_for(self, digest: str, release: str) -> bool:
        return (release, digest) in self.hashes


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


MARK = "_commfold_hook"  # on every wrapper commfold puts on vLLM: the hook's name
_records: list[tuple[str, object, str]] = []  # (hook, owner, name) of each class wrap


def wrap(owner, name: str, make, hook: str) -> bool:
    """owner.name = make(original), once per hook: the wrapper carries MARK (the
    hook's name) and the original as __wrapped__ (what ``missing`` and ``unwrap``
    follow). Other hooks' wrappers may sit under or over it. A class's or module's
    wrap is recorded for ``unwrap_hook``. False when this hook had wrapped it already."""
    own = name in vars(owner)
    original = vars(owner)[name] if own else getattr(owner, name)
    if isinstance(original, (staticmethod, classmethod)):
        raise TypeError(f"commfold: {name} is a {type(original).__name__}")
    if hook in wrapped_by(original):
        return False
    wrapped = make(original)
    wrapped.__wrapped__, wrapped.__name__ = original, name
    wrapped.__qualname__ = getattr(original, "__qualname__", name)
    setattr(wrapped, MARK, hook)
    wrapped._commfold_inherited = not own  # unwrap deletes it again
    setattr(owner, name, wrapped)
    if isinstance(owner, (type, types.ModuleType)):
        _records.append((hook, owner, name))
    return True


def wrapped_by(obj) -> list[str]:
    """The hooks whose wrappers `obj` is, outermost first."""
    hooks = []
    while isinstance(mark := getattr(obj, "__dict__", {}).get(MARK), str):
        hooks.append(mark)
        obj = obj.__wrapped__
    return hooks


def unwrap(owner, name: str, hook: str) -> bool:
    """Undo ``wrap`` of owner.name by `hook` (True when it was there); its wrapper must
    be the outermost (hooks are undone in the reverse order they were installed)."""
    current = vars(owner).get(name)
    found = wrapped_by(current)
    if hook not in found:
        return False
    if found[0] != hook:
        raise RuntimeError(f"commfold: {hook}'s wrapper of {name} is under {found[0]}'s: "
                           f"undo {found[0]} first")
    if current._commfold_inherited:
        delattr(owner, name)
    else:
        setattr(owner, name, current.__wrapped__)
    return True


def unwrap_hook(hook: str) -> int:
    """Undo every class and module wrap `hook` made, newest first (its uninstall);
    returns how many."""
    mine = [r for r in _records if r[0] == hook]
    for record in reversed(mine):
        unwrap(record[1], record[2], hook)
        _records.remove(record)
    return len(mine)


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
        here = releases.here()
        if here.release is None:
            return f"{where}: this vLLM is older than every release commfold claims"
        if not text.holds(source, here.release.version):
            return (f"{where} changed (source hash {source_hash(source)}; "
                    f"not {here.release.version}'s, read for {text.releases()})")
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
