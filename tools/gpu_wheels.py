"""The wheels tools/gpu_check.sh carries to the GPU machine (pytest, hypothesis and
what they need; pure Python only) and which of them that machine lacks.

    python tools/gpu_wheels.py check DIR     # every wheel pure Python; total size
    python tools/gpu_wheels.py missing DIR   # wheels of distributions not installed here
"""
from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

MAX_BYTES = 16 * 2**20  # the machine takes 64 MiB of carried files in all


def dist_name(wheel: Path) -> str:
    """The normalized distribution name of a wheel file (PEP 427: name-version-...)."""
    return wheel.name.split("-")[0].lower().replace("_", "-")


def installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def check(folder: Path) -> int:
    wheels = sorted(folder.glob("*.whl"))
    impure = [w.name for w in wheels if not w.name.endswith("-none-any.whl")]
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB: "
          + ", ".join(w.name.rsplit("-", 3)[0] for w in wheels))
    if not wheels or impure or size > MAX_BYTES:
        print(f"gpu_wheels: expected pure-Python wheels under {MAX_BYTES // 2**20} MiB; "
              f"impure: {impure or 'none'}", file=sys.stderr)
        return 1
    return 0


def missing(folder: Path) -> int:
    for wheel in sorted(folder.glob("*.whl")):
        if not installed(dist_name(wheel)):
            print(wheel)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("check", "missing"):
        print(__doc__, file=sys.stderr)
        return 2
    return {"check": check, "missing": missing}[argv[0]](Path(argv[1]))


if __name__ == "__main__":
    raise SystemExit(main())
