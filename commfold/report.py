"""What each pass rewrote or declined to rewrite, for users, the CLI and tests.

One Report per compiled graph. Reports are kept in process order; ``last_report()``
is the newest, ``reports()`` all of them since ``clear_reports()``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass, field

log = logging.getLogger("commfold")


@dataclass(frozen=True)
class Comm:
    """Communication of one call: bytes sent into collectives and collective calls."""

    bytes: int | str = 0
    calls: int = 0

    def __str__(self) -> str:
        return f"{format_bytes(self.bytes)} in {self.calls} call{'s' if self.calls != 1 else ''}"


@dataclass(frozen=True)
class Rewrite:
    pass_name: str
    pattern: str
    location: str
    comm_before: Comm
    comm_after: Comm
    extra_memory_bytes: int = 0
    detail: str = ""


@dataclass(frozen=True)
class NearMiss:
    pass_name: str
    pattern: str
    location: str
    reason: str
    code: str = ""  # the user's line of source at location (source_code), if known


@dataclass(frozen=True)
class AlreadyDone:
    """A site another library already rewrote as the pass would (never rewritten twice)."""
    pass_name: str
    pattern: str
    location: str
    by: str


@dataclass(frozen=True)
class PassError:
    pass_name: str
    error: str


@dataclass
class Report:
    graph_index: int = 0
    from_cache: bool = False  # replayed: Inductor's cache served the compiled graph
    passes: tuple[str, ...] = ()
    rewrites: list[Rewrite] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    errors: list[PassError] = field(default_factory=list)
    pass_seconds: dict[str, float] = field(default_factory=dict)
    already_done: list[AlreadyDone] = field(default_factory=list)
    # what canonicalization changed before the passes ran: {step: changes}
    # (commfold.canonicalize; the same graph on every rank, so not in the fingerprint)
    canonicalized: dict[str, int] = field(default_factory=dict)

    def count(self, pass_name: str | None = None, pattern: str | None = None) -> int:
        return sum(
            1
            for r in self.rewrites
            if (pass_name is None or r.pass_name == pass_name)
            and (pattern is None or r.pattern == pattern)
        )

    def fingerprint(self) -> str:
        """Hash of every decision (pass, pattern, rewritten or why not).

        Rank-local numbers (shard bounds, group handles) never enter reasons, so equal
        graphs and configs give equal fingerprints on every rank.
        """
        h = hashlib.sha256()
        for r in self.rewrites:
            h.update(f"R|{r.pass_name}|{r.pattern}|{r.comm_before}|{r.comm_after}\n".encode())
        for m in self.near_misses:
            h.update(f"N|{m.pass_name}|{m.pattern}|{m.reason}\n".encode())
        for e in self.errors:
            h.update(f"E|{e.pass_name}\n".encode())
        for a in self.already_done:
            h.update(f"A|{a.pass_name}|{a.pattern}|{a.by}\n".encode())
        return h.hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Report:
        def comm(c):
            return Comm(**c)
        return cls(
            graph_index=d.get("graph_index", 0), from_cache=d.get("from_cache", False),
            passes=tuple(d.get("passes", ())),
            rewrites=[Rewrite(**{**r, "comm_before": comm(r["comm_before"]),
                                 "comm_after": comm(r["comm_after"])}) for r in d["rewrites"]],
            near_misses=[NearMiss(**m) for m in d["near_misses"]],
            errors=[PassError(**e) for e in d["errors"]],
            pass_seconds=dict(d.get("pass_seconds", {})),
            already_done=[AlreadyDone(**a) for a in d.get("already_done", [])],
            canonicalized=dict(d.get("canonicalized", {})))

    def summary(self) -> str:
        cached = " - compiled graph served from Inductor's cache" if self.from_cache else ""
        lines = [f"commfold report, graph {self.graph_index}: "
                 f"{len(self.rewrites)} rewrite(s), {len(self.near_misses)} near-miss(es), "
                 f"{len(self.errors)} error(s){cached}"]
        if self.rewrites:
            rows = [("pass", "pattern", "source", "comm/call before -> after", "extra mem")]
            for r in self.rewrites:
                rows.append((r.pass_name, r.pattern, r.location,
                             f"{r.comm_before} -> {r.comm_after}",
                             format_bytes(r.extra_memory_bytes)))
            lines += _table(rows)
        if self.canonicalized:
            lines.append("  canonicalized before the passes: " + ", ".join(
                f"{n} {step}" for step, n in self.canonicalized.items()))
        for a in self.already_done:
            lines.append(f"  already done [{a.pass_name}/{a.pattern}] at {a.location}: by {a.by}")
        for m in self.near_misses:
            lines.append(f"  near-miss [{m.pass_name}/{m.pattern}] at {m.location}: {m.reason}")
            lines += code_lines(m.code)
        for e in self.errors:
            lines.append(f"  ERROR in {e.pass_name}: {e.error} (graph left unchanged by it)")
        return "\n".join(lines)


def _table(rows) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]


def format_bytes(n) -> str:
    """Bytes for people: 512 B, 1.5 KiB, 64.0 MiB; a symbolic count (text) as is."""
    if isinstance(n, str):
        return n + " B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def source_location(node) -> str:
    """`file:line (function)` of the user code that produced node, from its stack trace,
    and ` in <module path>` when the node came from inside an nn.Module (a shared
    helper's line - vLLM's RMSNorm op, say - then still says which layer it was).
    The user's code is the innermost frame outside torch itself (`dist.all_reduce`'s
    own frames, F.rms_norm's, are not what a user edits)."""
    frames = _frames(node)
    if not frames:
        return f"<graph node {node.name}>"
    path, line, fn, _ = frames[-1]
    short = "/".join(path.split("/")[-2:])
    module = module_path(node)
    return f"{short}:{line} ({fn})" + (f" in {module}" if module else "")


def source_code(node) -> str:
    """The user's line of source that produced node (`h = residual + out`), as its
    stack trace quotes it under source_location's frame; '' when there is none."""
    frames = _frames(node)
    return frames[-1][3] if frames else ""


def _frames(node) -> list[tuple[str, str, str, str]]:
    """(path, line, function, code) of node's stack trace, innermost last; torch's own
    frames dropped when any other is left."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    frames = []
    for i, ln in enumerate(lines):
        m = _FRAME.search(ln)
        if m:
            after = lines[i + 1] if i + 1 < len(lines) else ""
            frames.append((m[1], m[2], m[3], "" if _FRAME.search(after) else after.strip()))
    torch_dir = _torch_dir()
    mine = [f for f in frames if not f[0].startswith(torch_dir)]
    return mine or frames


def _torch_dir() -> str:
    import torch

    return os.path.dirname(torch.__file__) + os.sep


def code_lines(code: str, indent: str = "      ") -> list[str]:
    """A near-miss's source line as reports print it, under the near-miss ('' : none)."""
    return [f"{indent}| {code}"] if code else []


def module_path(node) -> str:
    """The innermost module the node was traced in (`model.layers.0.mlp`), or ''."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    fqn = str(list(stack.values())[-1][0])
    fqn = re.sub(r"^L\['self'\]\.?|^self\.?", "", fqn)
    return re.sub(r"\._modules\['([^']+)'\]|\['([^']+)'\]", lambda m: "." + (m[1] or m[2]), fqn)


_lock = threading.Lock()
_reports: list[Report] = []


def publish(report: Report) -> None:
    with _lock:
        report.graph_index = len(_reports)
        _reports.append(report)
    if report.errors:
        for e in report.errors:
            log.warning("commfold: pass %s failed and was skipped: %s", e.pass_name, e.error)
    log.info("%s", report.summary())
    if os.environ.get("COMMFOLD_REPORT_DIR"):
        _write_file(report, os.environ["COMMFOLD_REPORT_DIR"])


def _write_file(report: Report, out_dir: str) -> None:
    """One JSON file per report, named by rank and process: how reports come back
    from processes the caller did not start (vLLM's workers, one per rank)."""
    rank = _rank()
    path = os.path.join(out_dir, f"rank{rank}-pid{os.getpid()}-graph{report.graph_index}.json")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "pid": os.getpid(), **report.to_dict()}, f, default=str)
        os.replace(path + ".tmp", path)
    except OSError as e:  # a report must never break a compile
        log.warning("commfold: could not write report %s: %s", path, e)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", -1))


def last_report() -> Report | None:
    """The report of the most recent graph commfold saw in this process (None if none)."""
    with _lock:
        return _reports[-1] if _reports else None


def reports() -> list[Report]:
    with _lock:
        return list(_reports)


def clear_reports() -> None:
    with _lock:
        _reports.clear()
