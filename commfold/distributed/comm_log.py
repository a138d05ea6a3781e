"""Which collectives ran, with their sizes: read from torch.profiler's events - the
backends' own ("gloo:all_gather", "nccl:all_reduce", ...) and vLLM CPU's
shared-memory ops (``_C::shm_allreduce`` / ``shm_all_gather`` / ``shm_gather``, which
never reach a c10d backend) - so compiled code, eager code and commfold's own ops
(which call the same leaves) are all seen once, the same way.

``record_collectives()`` logs one block of code. Inside vLLM's engine,
COMMFOLD_COMM_LOG_DIR makes every worker rank write one JSON line per engine step
(``commfold.vllm.observe.step_log``); ``read_step_logs(dir)`` reads them back.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

_ITEMSIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
             "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}
_BACKENDS = ("gloo:", "nccl:", "mpi:", "ucc:")
# vLLM CPU's shared-memory collectives: (handle, data, ...) - data is this rank's part
_SHM_OPS = {"_C::shm_allreduce": "all_reduce", "_C::shm_all_gather": "all_gather",
            "_C::shm_gather": "gather"}
GATHERS = ("all_gather", "gather")


@dataclass(frozen=True)
class CommEvent:
    name: str  # e.g. "all_gather"
    shapes: tuple  # shapes of what this rank sends
    dtype: str
    phase: str | None = None  # engine step logs: where in the step it ran

    @property
    def elements(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    @property
    def bytes(self) -> int:
        return self.elements * _ITEMSIZE.get(self.dtype, 4)

    def to_json(self) -> dict:
        return dict(kind=self.name, shapes=[list(s) for s in self.shapes], dtype=self.dtype,
                    elements=self.elements, bytes=self.bytes, phase=self.phase)

    @classmethod
    def from_json(cls, d: dict) -> CommEvent:
        return cls(d["kind"], tuple(tuple(s) for s in d["shapes"]), d["dtype"], d.get("phase"))


@dataclass
class CommLog:
    events: list[CommEvent] = field(default_factory=list)

    def calls(self, name: str | None = None) -> int:
        return len(self.of(name))

    def of(self, name: str | None = None) -> list[CommEvent]:
        return [e for e in self.events if name is None or e.name == name]

    def elements(self, name: str | None = None) -> int:
        return sum(e.elements for e in self.of(name))

    def bytes(self, name: str | None = None) -> int:
        return sum(e.bytes for e in self.of(name))

    def in_phase(self, *phases: str) -> CommLog:
        return CommLog([e for e in self.events if e.phase in phases])

    def vocab_gathers(self, vocab_shard: int) -> list[CommEvent]:
        """(all-)gathers whose rows are at least `vocab_shard` wide: gathered logits
        (the pair / top-k / statistics exchanges send a few values per row)."""
        return [e for e in self.events if e.name in GATHERS
                and any(s and s[-1] >= vocab_shard for s in e.shapes)]

    def __repr__(self) -> str:
        events = ", ".join(f"{e.name}{list(e.shapes)}:{e.dtype}" for e in self.events)
        return f"CommLog({events})"


# A collective that reaches no profiler event of its own (NCCL called through ctypes by
# vLLM's PyNccl, CUDA custom all-reduce kernels): the communicator's method is wrapped
# in a record_function span (``marked``) whose name carries kind, dtype and shapes.
# Backend events inside such a span (a communicator falling back to torch.distributed)
# are the same collective: counted once, as the span.
_MARK = "commfold.comm:"
_DTYPE_NAMES = {"float32": "float", "float64": "double", "float16": "c10::Half",
                "bfloat16": "c10::BFloat16", "int64": "long int", "int32": "int",
                "int16": "short int", "int8": "signed char", "uint8": "unsigned char",
                "bool": "bool"}


def marked(kind: str, tensors):
    """Profiler span naming a collective of `kind` sending `tensors` (this rank's)."""
    import torch

    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "?"
    shapes = json.dumps([list(t.shape) for t in tensors], separators=(",", ":"))
    return torch.autograd.profiler.record_function(
        f"{_MARK}{kind}|{_DTYPE_NAMES.get(dtype, dtype)}|{shapes}")


def collective_event(e, phase: str | None = None) -> CommEvent | None:
    """The CommEvent of one kineto event, or None if it is not a leaf collective."""
    name = e.name()
    if name.startswith(_MARK):
        kind, dtype, shapes = name[len(_MARK):].split("|", 2)
        return CommEvent(kind, tuple(tuple(s) for s in json.loads(shapes)), dtype, phase)
    if name.startswith(_BACKENDS):
        shapes = tuple(tuple(s) for s in e.shapes() if s)
        dtypes = [d for d in e.dtypes() if d]
        return CommEvent(name.split(":", 1)[1], shapes, dtypes[0] if dtypes else "?", phase)
    kind = _SHM_OPS.get(name)
    if kind is not None:
        shapes, dtypes = e.shapes(), e.dtypes()
        data = tuple(shapes[1]) if len(shapes) > 1 else ()
        return CommEvent(kind, (data,), dtypes[1] if len(dtypes) > 1 else "?", phase)
    return None


def collective_events(events, phase_of=lambda t: None) -> list[CommEvent]:
    """The CommEvents of kineto events, each collective once (a leaf inside a marked
    span is that span's); phase_of(start_ns) names each one's phase."""
    events = list(events)
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events
             if e.name().startswith(_MARK)]
    out = []
    for e in events:
        t, own = e.start_ns(), (e.start_ns(), e.start_ns() + e.duration_ns())
        inside = any(a <= t <= b and (a, b) != own for a, b in spans)  # a nested one
        c = None if inside else collective_event(e, phase_of(t))
        if c is not None:
            out.append(c)
    return out


@contextmanager
def record_collectives():
    """with record_collectives() as log: ...  then log.calls("all_gather"), log.bytes()."""
    from torch.profiler import ProfilerActivity, profile

    log = CommLog()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield log
    log.events.extend(collective_events(prof.profiler.kineto_results.events()))


# --- per engine step logs written inside vLLM's workers ---------------------------

@dataclass
class StepLog(CommLog):
    """The collectives one worker rank ran in one engine step, with what the step
    was (``info``: tokens, requests, spec_tokens, and notes added by commfold's
    hooks, e.g. ``target_pick``)."""
    rank: int = 0
    step: int = 0
    info: dict = field(default_factory=dict)
    pid: int | None = None  # the worker process (engine runs in one directory)


def read_step_logs(directory: str | Path) -> dict[int, list[StepLog]]:
    """rank -> its steps in order, from the rank<r>.jsonl files of a
    COMMFOLD_COMM_LOG_DIR."""
    out: dict[int, list[StepLog]] = {}
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            events = [CommEvent.from_json(x) for x in d.pop("events")]
            rank, step, pid = d.pop("rank"), d.pop("step"), d.pop("pid", None)
            out.setdefault(rank, []).append(StepLog(events, rank=rank, step=step, info=d,
                                                    pid=pid))
    return out
