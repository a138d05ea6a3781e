"""vLLM releases' Python sources, from their wheels, cached once per machine: what
tools/vllm_release.py pins and the tests that read a release's code (0.33, 0.34: CUDA
wheels that cannot be installed here) both take from here, never from a developer's
own unpacked copy.

``release_tree(version)`` is the `vllm/` package of a release: its wheel (looked for
first in $COMMFOLD_WHEELS, then in ``${XDG_CACHE_HOME:-~/.cache}/commfold/wheels``,
else ``pip download <distribution>==<version> --no-deps`` there; never installed),
of which only ``vllm/**/*.py`` and the dist-info's METADATA (the distribution's name,
for tools/vllm_compat.py's column labels) are extracted, once, into
``.../commfold/vllm-src/<version>/``. The distribution is the registry's
(commfold.vllm.compat.releases) for a claimed release, else the caller's.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REASONS: dict[str, str] = {}  # version -> why its tree could not be had (release_tree)


class Unavailable(Exception):
    """A release's sources cannot be had; `network` when only the network failed
    (tests skip on that even in CI)."""

    def __init__(self, reason: str, network: bool = False):
        super().__init__(reason)
        self.network = network


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "commfold"


def distribution_of(version: str, distribution: str | None = None) -> str:
    """The distribution that ships `version`: the caller's, else the registry's, else vllm."""
    if distribution:
        return distribution
    from commfold.vllm.compat import releases

    found = releases.get(version)
    return found.distribution if found else "vllm"


def _wheel_glob(distribution: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', distribution)}-{version}-*.whl"


def find_wheel(distribution: str, version: str) -> Path | None:
    """A wheel of distribution==version already at hand ($COMMFOLD_WHEELS, the cache)."""
    dirs = [Path(d) for d in os.environ.get("COMMFOLD_WHEELS", "").split(os.pathsep) if d]
    for folder in dirs + [cache_root() / "wheels"]:
        found = sorted(folder.glob(_wheel_glob(distribution, version))) if folder.is_dir() \
            else []
        if found:
            return found[0]
    return None


def download(distribution: str, version: str, dest: Path) -> Path:
    """pip download distribution==version (the wheel alone) into dest; raises
    Unavailable saying whether the version does not exist or the network failed."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"{distribution}=={version}", "--no-deps",
           "--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", str(dest)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(_wheel_glob(distribution, version)))
    if done.returncode == 0 and found:
        return found[0]
    out = done.stdout + done.stderr
    if re.search(r"No matching distribution|Could not find a version", out):
        raise Unavailable(f"{distribution}=={version} has no wheel on the package index "
                          "(check the version and --distribution)")
    last = next((line for line in reversed(out.splitlines()) if line.strip()), "no output")
    raise Unavailable(f"could not download {distribution}=={version} ({last.strip()}); "
                      "check the network or put its wheel in $COMMFOLD_WHEELS", network=True)


def extract(wheel: Path, dest: Path) -> Path:
    """The wheel's vllm/**/*.py and dist-info METADATA into dest (replaced whole, so
    a half-done extraction is never read); returns dest/vllm."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if (n.startswith("vllm/") and n.endswith(".py"))
                     or re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            z.extractall(tmp, names)
        if (dest / "vllm" / "_version.py").is_file():
            return dest / "vllm"  # another process extracted it meanwhile
        shutil.rmtree(dest, ignore_errors=True)  # a broken earlier one
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "vllm"


def tree(version: str, distribution: str | None = None, fetch=None) -> Path:
    """The `vllm/` sources of distribution==version (see the module's doc); raises
    Unavailable. `fetch(distribution, version, dest) -> wheel` (tests: no network)."""
    dist = distribution_of(version, distribution)
    dest = cache_root() / "vllm-src" / version
    if (dest / "vllm" / "_version.py").is_file():
        return dest / "vllm"
    wheel = find_wheel(dist, version) or (fetch or download)(dist, version,
                                                             cache_root() / "wheels")
    try:
        package = extract(wheel, dest)
    except zipfile.BadZipFile as e:
        raise Unavailable(f"{wheel} is not a wheel ({e}); delete it and retry") from e
    if not (package / "_version.py").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        raise Unavailable(f"{wheel} has no vllm/_version.py: not a vLLM wheel")
    return package


def claimed_trees() -> list[Path]:
    """The `vllm/` sources of every claimed release that can be had (tests that read
    each release's code; the others' reasons in REASONS)."""
    from commfold.vllm.compat import releases

    return [t for r in releases.claimed() if (t := release_tree(r.version, r.distribution))]


def release_tree(version: str, distribution: str | None = None) -> Path | None:
    """The `vllm/` sources of a release, or None with the reason in REASONS[version]."""
    try:
        return tree(version, distribution)
    except Unavailable as e:
        REASONS[version] = str(e)
        return None
