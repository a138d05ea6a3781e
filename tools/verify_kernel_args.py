"""Check commfold.vllm.spec_decode.verify_kernels' launches against a vLLM release's sources,
without installing or importing that release: for a release whose classes cannot run
here (vLLM 0.33), the check that each of V2's rejection kernels would get exactly its
parameters.

    python tools/verify_kernel_args.py 0.33.0 [0.34.0 | a vllm dir ...]

A version is its claimed release's sources from the wheel cache (harness.vllm_sources).
For each source tree: the release whose argument list each kernel takes (the pinned
hash its source has, as verify_kernels.form reads the installed one), then each
launch function run with the kernels replaced by recorders (in this Python's vLLM:
harness.vllm_verify_v2.launch_arguments) and the names it passes compared with the
kernel's parameters in that tree. Exit status 1 on a mismatch or an unpinned source.
"""
from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

from vllm_compat import Sources, _package  # noqa: E402

from commfold.vllm.compat import releases  # noqa: E402
from commfold.vllm.spec_decode import verify_kernels  # noqa: E402
from commfold.vllm.compat.hook_points import source_hash  # noqa: E402

_FILE = "v1/worker/gpu/spec_decode/rejection_sampler_utils.py"


def check(package: Path) -> bool:
    from harness.vllm_verify_v2 import launch_arguments

    src = Sources(package)
    release = releases.taken_as(src.version())
    if release is None:
        print(f"{src.version()}: older than every release commfold claims")
        return False
    for where, pinned in verify_kernels.POINTS:
        digest = source_hash(src.find(where))
        if not pinned.holds_for(digest, release.version):
            print(f"{src.version()}: {where} is not {release.version}'s pinned source ({digest})")
            return False
    tree = ast.parse((package / _FILE).read_text())
    ok = True
    for name, (passed, _) in launch_arguments(1, release.numbers).items():
        kernel = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        params = sorted(a.arg for a in kernel.args.args)
        same = passed == params
        ok &= same
        print(f"{src.version()}: {name} as {release.version}: "
              + ("its parameters" if same else f"differs: {sorted(set(passed) ^ set(params))}"))
    return ok


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return 0 if all([check(_tree(a)) for a in args or ["installed"]]) else 1


def _tree(arg: str) -> Path:
    """A vllm dir, 'installed', or a release version (its sources from the wheel cache)."""
    if re.fullmatch(r"\d+\.\d+\.\d+", arg):
        from harness import vllm_sources

        return vllm_sources.tree(arg)
    return _package(arg)


if __name__ == "__main__":
    sys.exit(main())
