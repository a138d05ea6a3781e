"""Build every C++ kernel for this CPU now: `python -m commfold.ops.prebuild`.

install.sh runs it, so neither the first test nor a user's first compiled call pays
the one-off build (~2 minutes on 2 cores). Builds are keyed on source, flags and CPU
features (cpp_build), so a build made here is only ever loaded on a CPU like this one;
a machine without a compiler keeps the composite torch paths and says so."""
from __future__ import annotations

import sys
import time


def main() -> int:
    from commfold.ops import add_rmsnorm_cpu, vocab_scan

    for name, build in (("add_rmsnorm", add_rmsnorm_cpu.module),
                        ("vocab_scan", vocab_scan.module)):
        t0 = time.perf_counter()
        ok = build() is not None
        print(f"commfold: C++ kernel {name}: "
              f"{'built' if ok else 'unavailable, torch fallback'} "
              f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
