"""commfold runs on any x86-64 CPU with AVX2 and on aarch64, not only on the CPU it
was developed on.

- vLLM CPU ships three builds of its kernels on x86 (``_C``: AVX-512 + BF16,
  ``_C_AVX512``, ``_C_AVX2``) and picks one by CPU flags; ``import vllm._C`` on an
  AVX2-only CPU dies with SIGILL. Nothing here may load one except the way vLLM does
  (``current_platform.import_kernels()``), and commfold's own ops must work on the
  AVX2 build.
- commfold's C++ kernels are built with -march=native and cached on disk, which may
  be shared: the build is keyed on the CPU's features, so another CPU builds its own.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch

from commfold.ops import add_rmsnorm_cpu, cpp_build

ROOT = Path(__file__).resolve().parent.parent
KERNEL_MODULES = ("vllm._C", "vllm._C_AVX2", "vllm._C_AVX512")


def _python_files():
    for folder in ("commfold", "passes", "patterns", "tests", "benchmarks", "examples",
                   "harness"):
        yield from (ROOT / folder).rglob("*.py")


def _kernel_loads(tree: ast.AST) -> list[str]:
    """Direct loads of a vLLM kernel library: imports of vllm._C*, and
    torch.ops.load_library / ctypes on a path naming one."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
                "load_library", "CDLL", "import_module"):
            names = [a.value for a in node.args if isinstance(a, ast.Constant)
                     and isinstance(a.value, str)]
        found += [n for n in names if any(n == k or n.startswith(k + ".") or
                                          f"{k.replace('.', '/')}." in n
                                          for k in KERNEL_MODULES)]
    return found


def test_no_direct_load_of_a_vllm_kernel_library():
    offenders = {str(p.relative_to(ROOT)): hits for p in _python_files()
                 if (hits := _kernel_loads(ast.parse(p.read_text(), str(p))))}
    assert offenders == {}, ("load vLLM's kernels with "
                             "vllm.platforms.current_platform.import_kernels()")


def test_the_scan_finds_direct_loads():
    """The scan above is not blind: each spelling of a direct load is caught."""
    for text in ("import vllm._C", "import vllm._C_AVX2 as k", "from vllm import _C",
                 "torch.ops.load_library('site/vllm/_C.abi3.so')",
                 "importlib.import_module('vllm._C_AVX512')"):
        assert _kernel_loads(ast.parse(text)), text
    assert not _kernel_loads(ast.parse("from vllm.platforms import current_platform"))


def test_native_builds_are_keyed_on_the_cpu():
    src = add_rmsnorm_cpu.SOURCE.read_bytes()
    avx512 = "x86_64:avx avx2 avx512f f16c fma"
    avx2 = "x86_64:avx avx2 f16c fma"
    native = ["-O3", "-march=native"]
    assert cpp_build.build_key(src, native, avx512) != cpp_build.build_key(src, native, avx2)
    # a portable build runs anywhere: one key for every CPU
    assert cpp_build.build_key(src, ["-O3"], avx512) == cpp_build.build_key(src, ["-O3"], avx2)
    # the same source in another checkout: its own build (ninja rebuilds a name whose
    # source path changed, so two checkouts sharing one cache would rebuild each other)
    assert cpp_build.build_key(src, native, avx2, "/a/k.cpp") \
        != cpp_build.build_key(src, native, avx2, "/b/k.cpp")
    assert cpp_build.build_key(src + b" ", native, avx2) != cpp_build.build_key(src, native, avx2)
    # another torch: its own build (a binary linked against one torch's ABI crashes another)
    assert cpp_build.build_key(src, ["-O3"], avx2, "/a/k.cpp", "2.13.0+cpu") \
        != cpp_build.build_key(src, ["-O3"], avx2, "/a/k.cpp", "2.14.1+cu130")


def test_load_names_the_build_after_this_cpu(monkeypatch, tmp_path):
    """What cpp_build.load hands to torch's builder: the build's name changes with the
    CPU features (so a cache shared with another CPU is never loaded) and the flags
    are native only where features were read."""
    calls = []
    monkeypatch.setattr("torch.utils.cpp_extension.load",
                        lambda name, **kw: calls.append((name, kw["extra_cflags"])) or name)
    names = []
    for features in ("x86_64:avx avx2 avx512f", "x86_64:avx avx2", ""):
        monkeypatch.setattr(cpp_build, "cpu_features", lambda f=features: f)
        monkeypatch.setattr(cpp_build, "_loaded", {})
        names.append(cpp_build.load("probe", add_rmsnorm_cpu.SOURCE))
    assert len(set(names)) == 3, names
    assert ["-march=native" in flags for _, flags in calls] == [True, True, False]
    # a copy of the sources (a second checkout): another name, one build per path
    copy = tmp_path / "ops"
    shutil.copytree(add_rmsnorm_cpu.SOURCE.parent, copy,
                    ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(cpp_build, "_loaded", {})
    assert cpp_build.load("probe", copy / add_rmsnorm_cpu.SOURCE.name) != names[-1]
    monkeypatch.setenv("COMMFOLD_PORTABLE_KERNELS", "1")
    assert cpp_build.arch_flags() == []


def test_this_cpu_has_features_to_key_on():
    """Where /proc/cpuinfo exists (Linux x86-64 / aarch64) the key sees the features
    the kernel's fast paths use."""
    feats = cpp_build.cpu_features()
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo: builds are portable here")
    if feats.startswith("x86_64:"):
        assert " avx2 " in f" {feats.split(':', 1)[1]} "
    assert feats


def vllm_tp_on_avx2_kernels():
    """On a rank: make vLLM see an AVX2-only CPU (what an AMD EPYC without AVX-512
    reports), set up its TP group through commfold's helper, and run commfold's fused
    op on that group beside vLLM's own all-reduce."""
    import torch.distributed as dist

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    from commfold.ops.allreduce_rmsnorm import pack_flags
    from harness.vllm_tp import init_vllm_tp, shm_supported

    shm = shm_supported()  # loads vLLM's kernels as vLLM does
    try:
        init_vllm_tp(2, shm=True)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    tp = init_vllm_tp(2, shm=False)
    rank = dist.get_rank()
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
    total = tp.all_reduce(x.clone())  # vLLM's own all-reduce on this group
    out = torch.ops.commfold.allreduce_rmsnorm(x, None, None, 1e-6, 0.0, pack_flags(),
                                               f"c10d:{tp.device_group.group_name}")
    maps = Path("/proc/self/maps").read_text()
    libs = {Path(line.split()[-1]).name for line in maps.splitlines() if "/vllm/" in line}
    expected = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
    return dict(libs=sorted(libs), shm=shm, refused=refused,
                reduced=torch.equal(x, total) and torch.equal(total, x * 0 + torch.arange(
                    12, dtype=torch.float32).reshape(3, 4) * 3),
                normed=torch.allclose(out, expected, rtol=1e-6, atol=0))


@pytest.mark.ranks
@pytest.mark.vllm
def test_vllm_tp_on_the_avx2_kernel_build():
    """vLLM's AVX2 build is the one loaded (never _C), it has no shared-memory
    collectives - the helper says so in one line instead of dying - and commfold's op
    runs on the gloo group vLLM falls back to."""
    from harness.vllm_models import require_vllm

    require_vllm()
    from commfold.distributed.ranks import RankPool

    with RankPool(2, timeout=300, threads=1) as pool:
        for row in pool.run(vllm_tp_on_avx2_kernels):
            assert "_C_AVX2.abi3.so" in row["libs"], row
            assert "_C.abi3.so" not in row["libs"] and "_C_AVX512.abi3.so" not in row["libs"], row
            assert not row["shm"] and "use shm=False" in row["refused"], row
            assert row["reduced"] and row["normed"], row


def test_prebuild_builds_every_kernel_install_sh_promises(capsys):
    """install.sh builds the C++ kernels up front (python -m commfold.ops.prebuild), so no
    test and no user's first call pays the build; every kernel the ops load is in it."""
    from commfold.ops import prebuild

    assert prebuild.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[1].split()[-1] for ln in lines] == ["add_rmsnorm", "vocab_scan"]
    assert all(": built (" in ln for ln in lines), lines
    install = (ROOT / "install.sh").read_text()
    assert "python3 -m commfold.ops.prebuild" in install


def test_a_killed_builds_lock_is_removed(tmp_path, caplog):
    """torch waits forever on a build directory's `lock` file; one found while
    commfold's own (kernel-released) lock is held was left by a dead build."""
    import logging

    build = tmp_path / "commfold_x_0123"
    build.mkdir()
    (build / "lock").write_text("")
    with caplog.at_level(logging.WARNING, logger="commfold"):
        with cpp_build.build_lock("commfold_x_0123", str(build)):
            assert not (build / "lock").exists()
    assert "killed midway" in caplog.text


def test_a_live_build_is_waited_for(tmp_path):
    """A second builder waits for the first (who still holds torch's lock file) and
    finds the lock gone when the first one is done."""
    import threading
    import time

    build = tmp_path / "commfold_y_0123"
    build.mkdir()
    order = []

    def first():
        with cpp_build.build_lock("y", str(build)):
            (build / "lock").write_text("")  # torch's, while building
            order.append("first in")
            time.sleep(0.3)
            (build / "lock").unlink()  # torch removes it when the build is done
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    while not order:
        time.sleep(0.01)
    with cpp_build.build_lock("y", str(build)):
        order.append("second in")
    t.join()
    assert order == ["first in", "first out", "second in"]
