"""Which collectives ran, with their sizes: read from torch.profiler's backend-level
events ("gloo:all_gather", "nccl:all_reduce", ...), so compiled code, eager code and
commfold's own ops are all seen the same way."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

_ITEMSIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
             "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}
_BACKENDS = ("gloo:", "nccl:", "mpi:", "ucc:")


@dataclass(frozen=True)
class CommEvent:
    name: str  # e.g. "all_gather"
    shapes: tuple  # input shapes the backend saw
    dtype: str

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

    def __repr__(self) -> str:
        return "CommLog(" + ", ".join(f"{e.name}{list(e.shapes)}:{e.dtype}" for e in self.events) + ")"


@contextmanager
def record_collectives():
    """with record_collectives() as log: ...  then log.calls("all_gather"), log.bytes()."""
    from torch.profiler import ProfilerActivity, profile

    log = CommLog()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield log
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name.startswith(_BACKENDS):
            shapes = tuple(tuple(s) for s in e.shapes() if s)
            dtypes = [d for d in e.dtypes() if d]
            log.events.append(CommEvent(name.split(":", 1)[1], shapes, dtypes[0] if dtypes else "?"))
