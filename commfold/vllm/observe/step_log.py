"""Per engine step collective log inside vLLM's worker processes.

With COMMFOLD_COMM_LOG_DIR=dir, the vLLM plugin (``register()``, which vLLM calls in
every process it starts) installs this: each worker rank appends one JSON line per
engine step to ``dir/rank<r>.jsonl`` - the collectives that really ran (kind, shapes,
dtype, elements, bytes) and the phase of the step each ran in. An engine step is one
``execute_model`` (the model forward, the target's logits) and the ``sample_tokens``
after it (sampling or spec-decode verification, prompt logprobs, draft proposals).

Collectives are read from torch.profiler's events, which see every dispatcher call
(compiled graphs, eager code, C++ ops calling other ops): vLLM CPU's shared-memory
ops and the c10d backends' own events (gloo fallback; commfold's ops on c10d groups).
Only those leaves are counted, so a collective reached through a wrapper (vLLM's
custom ops, c10d's dispatcher ops, commfold's ops) is counted once. vLLM's CUDA
communicator (PyNccl through ctypes, custom all-reduce kernels) makes no such event:
its collective methods are marked instead (comm_log.marked), each counted once; a
collective replayed inside a CUDA graph runs no Python and is not seen.

Phases (the outermost one that applies): ``forward`` (the runner's model forward),
``logits`` (a LogitsProcessor call outside the two below: the target's logits),
``sampling`` (the sampler, or the rejection sampler under spec decoding),
``prompt_logprobs``, ``drafting`` (the drafter's proposals, its own forward and
logits included), ``other`` (the rest of the step); ``compile`` for collectives a
torch.compile traced during the step (on fake tensors: nothing was sent). Hooks add
facts about a step with ``note(key, value)`` (e.g. the target-pick decision).

Cost when on: a profiler around every step (~10-30 ms a step on 2 cores; kineto
prints two "USDT ... profiler_start/stop" lines to stderr per step); none while
``dir/paused`` exists (a benchmark times its runs paused, then logs one run). Nothing is
installed when the variable is unset. Read the files with
``commfold.distributed.comm_log.read_step_logs``.

The log wraps the model runner vLLM builds: V1's methods above, or Model Runner
V2's ``execute_model`` (its forward: phase ``forward``), ``sample_tokens`` and
``sample`` (``sampling``; V2's drafting runs inside sample_tokens and reads as
``other``). With a method it wraps gone it stays off and says so in one line at
install (commfold.vllm.compat.runtime), as when it is on.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from commfold.vllm.compat import hook_points

log = logging.getLogger("commfold")

ENV_DIR = "COMMFOLD_COMM_LOG_DIR"
PAUSED = "paused"  # while dir/paused exists no step is recorded (nor profiled)
_PHASE = "commfold.phase:"
# runner method -> phase; LogitsProcessor methods are "logits" (see _LOGITS)
_RUNNER_PHASES = {"_model_forward": "forward", "_sample": "sampling",
                  "_get_prompt_logprobs_dict": "prompt_logprobs",
                  "propose_draft_token_ids": "drafting"}
_LOGITS = ("forward", "get_top_tokens", "get_top_k_tokens")
# torch.compile's own spans: collectives dispatched inside them are traced on fake
# tensors (a compile during the step), not run: phase "compile"
_COMPILING = " (dynamo_timed)"

# vLLM's CUDA communicator sends through PyNccl (NCCL via ctypes), custom / quick
# all-reduce, symmetric memory or FlashInfer: no profiler event of their own, so its
# collective methods are marked (comm_log.marked); recv is the peer's send
DEVICE_COMMUNICATOR = "vllm.distributed.device_communicators.cuda_communicator:CudaCommunicator"
DEVICE_METHODS = {"all_reduce": "all_reduce", "all_gather": "all_gather",
                  "all_gatherv": "all_gather", "reduce_scatter": "reduce_scatter",
                  "reduce_scatterv": "reduce_scatter", "broadcast": "broadcast",
                  "send": "send"}

# PyNccl itself: vLLM 0.34 calls it directly (batch-sharded sampling's
# all_to_all_single, DSpark's sharded Markov all_gather), not through the communicator;
# method -> (kind, the parameter holding what this rank sends). A call the communicator
# makes is inside its marked span and counted once (comm_log.collective_events)
PYNCCL = "vllm.distributed.device_communicators.pynccl:PyNcclCommunicator"
PYNCCL_METHODS = {"all_reduce": ("all_reduce", "in_tensor"),
                  "all_gather": ("all_gather", "input_tensor"),
                  "all_gatherv": ("all_gather", "input_tensor"),
                  "reduce_scatter": ("reduce_scatter", "input_tensor"),
                  "reduce_scatterv": ("reduce_scatter", "input_tensor"),
                  "reduce": ("reduce", "input_tensor"),
                  "scatter": ("scatter", "input_tensor"),
                  "all_to_all_single": ("all_to_all", "input_tensor"),
                  "broadcast": ("broadcast", "tensor"), "send": ("send", "tensor")}

HOOK = "step log"
# what must exist in vLLM for every phase to be seen (see hook_points)
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner."
_PROCESSOR = "vllm.model_executor.layers.logits_processor:LogitsProcessor."
HOOK_POINTS = tuple((_RUNNER + m, None) for m in ("execute_model", "sample_tokens",
                                                  *_RUNNER_PHASES)) \
    + tuple((_PROCESSOR + m, None) for m in _LOGITS)
# Model Runner V2: execute_model is the forward, sample_tokens calls sample()
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner."
_V2_PHASES = {"sample": "sampling"}
# V2's prompt logprobs: its worker computes them after sample(), from the gathered logits
_V2_PROMPT = "vllm.v1.worker.gpu.sample.prompt_logprob:PromptLogprobsWorker"
_V2_PROMPT_METHODS = ("compute_prompt_logprobs", "compute_prompt_token_id_logprobs")
HOOK_POINTS_V2 = tuple((_V2_RUNNER + m, None) for m in ("execute_model", "sample_tokens",
                                                        *_V2_PHASES)) \
    + tuple((f"{_V2_PROMPT}.{m}", None) for m in _V2_PROMPT_METHODS) \
    + tuple((_PROCESSOR + m, None) for m in _LOGITS)

_recorder: _StepRecorder | None = None


def note(key: str, value) -> None:
    """Add a fact to the current step's line (no-op when the log is off)."""
    if _recorder is not None and _recorder.prof is not None:
        _recorder.info[key] = value


def phase(name: str):
    """Context manager marking a phase of the current step (no-op when off)."""
    if _recorder is None or _recorder.prof is None:
        return nullcontext()
    import torch

    return torch.autograd.profiler.record_function(_PHASE + name)


class _StepRecorder:
    def __init__(self, directory: str):
        self.directory = Path(directory)
        self.step = 0
        self.prof = None
        self.info: dict = {}

    def begin(self, scheduler_output) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self.prof is not None:  # the last step had no sample_tokens
            self.end()
        if (self.directory / PAUSED).exists():  # a benchmark's timed runs: no profiler
            return
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        self.info = dict(tokens=getattr(scheduler_output, "total_num_scheduled_tokens", None),
                         requests=len(getattr(scheduler_output, "num_scheduled_tokens", {})),
                         spec_tokens=sum(len(v) for v in spec.values()))
        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self.prof.__enter__()
        self.outer = phase("other")
        self.outer.__enter__()

    def end(self) -> None:
        import torch.distributed as dist

        from commfold.distributed.comm_log import collective_events

        prof, self.prof = self.prof, None
        if prof is None:
            return
        self.outer.__exit__(None, None, None)
        prof.__exit__(None, None, None)
        events = list(prof.profiler.kineto_results.events())
        spans = sorted(((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[len(_PHASE):])
                        for e in events if e.name().startswith(_PHASE)), key=lambda s: s[0])
        compiling = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events
                     if e.name().endswith(_COMPILING)]
        found = [c.to_json() for c in collective_events(events, lambda t: (
            "compile" if any(a <= t <= b for a, b in compiling) else _phase_at(spans, t)))]
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        line = dict(rank=rank, pid=os.getpid(), step=self.step, **self.info, events=found)
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        self.step += 1


def _phase_at(spans, t: int) -> str:
    """The outermost named phase whose span holds t ("other" spans the whole step)."""
    for start, stop, name in spans:
        if start > t:
            break
        if t <= stop and name != "other":
            return name  # sorted by start: the first span holding t is the outermost
    return "other"


def state(environ=os.environ, runner=None):
    """The step log's state (runtime.HookState), installing nothing."""
    from commfold.vllm.compat import runtime

    off = None if environ.get(ENV_DIR, "").strip() else f"{ENV_DIR} unset"
    runner = runner or runtime.runner_choice(environ)
    points = HOOK_POINTS_V2 if runner.version == 2 else HOOK_POINTS
    hook = runtime.gate(HOOK, off=off, environ=environ, runner=runner,
                             version=2 if runner.version == 2 else 1,
                             missing=lambda: hook_points.missing(points))
    if hook.on:  # what it counts: collectives that reach a profiler event it knows
        hook = replace(hook, reason=hook.reason + "; counts c10d (gloo, NCCL), vLLM CPU "
                       "shared-memory and vLLM CUDA communicator (PyNccl, custom "
                       "all-reduce) collectives, not those replayed inside a CUDA graph "
                       "(log with enforce_eager=True)")
    return hook


def install(environ=os.environ, runner=None) -> bool:
    """Install the step log when COMMFOLD_COMM_LOG_DIR is set (once per process,
    logging one line, on or off and why); True if installed."""
    global _recorder
    if _recorder is not None:
        return True
    from commfold.vllm.compat import runtime

    runner = runner or runtime.runner_choice(environ)
    if not state(environ, runner).log().on:
        return False
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    if runner.version == 2:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        phases, forward = _V2_PHASES, "forward"
    else:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        phases, forward = _RUNNER_PHASES, None

    _recorder = _StepRecorder(environ[ENV_DIR].strip())
    _wrap(GPUModelRunner, "execute_model", lambda original: _step_start(original, forward))
    _wrap(GPUModelRunner, "sample_tokens", _step_finish)
    for method, name in phases.items():
        _wrap(GPUModelRunner, method, _in_phase(name))
    if runner.version == 2:
        from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker

        for method in _V2_PROMPT_METHODS:
            _wrap(PromptLogprobsWorker, method, _in_phase("prompt_logprobs"))
    for method in _LOGITS:
        _wrap(LogitsProcessor, method, _in_phase("logits"))
    for where, wrap in ((DEVICE_COMMUNICATOR, wrap_device_communicator), (PYNCCL, wrap_pynccl)):
        module, _, name = where.partition(":")
        try:
            wrap(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError) as e:  # a build without it: nothing to count
            log.info("commfold: step log: %s not wrapped (%s)", where, e)
    return True


def wrap_device_communicator(cls) -> None:
    """Mark each collective method of a device communicator class (DEVICE_METHODS) for
    the step log: what it sends, in the phase it runs in, counted once."""
    for method, kind in DEVICE_METHODS.items():
        _wrap(cls, method, _marked(kind))


def pynccl_sent(cls) -> dict[str, tuple[str, int, str] | str]:
    """method -> (kind, position, name) of the tensor it sends, by its signature, or
    why it is not counted (absent, or its parameters are not the ones expected)."""
    import inspect

    out = {}
    for method, (kind, sent) in PYNCCL_METHODS.items():
        fn = cls.__dict__.get(method)
        if fn is None:
            out[method] = "absent"
            continue
        params = list(inspect.signature(inspect.unwrap(fn)).parameters)
        out[method] = (kind, params.index(sent) - 1, sent) if sent in params[1:] else \
            f"no parameter {sent} ({', '.join(params[1:])})"
    return out


def wrap_pynccl(cls) -> None:
    """Mark PyNccl's collective methods for the step log (those whose signature names
    what they send; one line names any other), skipping a disabled communicator's
    calls (they send nothing)."""
    skipped = []
    for method, sent in pynccl_sent(cls).items():
        if isinstance(sent, str):
            if sent != "absent":
                skipped.append(f"{method}: {sent}")
            continue
        _wrap(cls, method, _marked(sent[0], sent[1], sent[2]))
    if skipped:
        log.info("commfold: step log: PyNccl methods not counted: %s", "; ".join(skipped))


def _marked(kind: str, position: int = 0, name: str | None = None):
    """A wrapper marking each call as a collective of `kind` sending the argument at
    `position` (or keyword `name`)."""
    def make(original):
        def run(self, *args, **kwargs):
            if _recorder is None or _recorder.prof is None or getattr(self, "disabled", False):
                return original(self, *args, **kwargs)
            from commfold.distributed.comm_log import marked

            tensor = args[position] if len(args) > position else kwargs.get(name)
            with marked(kind, tensor if isinstance(tensor, (list, tuple)) else [tensor]):
                return original(self, *args, **kwargs)
        return run
    return make


def _wrap(cls, method: str, make) -> None:
    """hook_points.wrap of a method `cls` itself defines (others are not counted)."""
    if method in vars(cls):
        hook_points.wrap(cls, method, make, HOOK)


def uninstall() -> None:
    """Undo install() (tests: vLLM's own methods back, no step recorded)."""
    global _recorder
    hook_points.unwrap_hook(HOOK)
    _recorder = None


def _in_phase(name: str):
    def make(original):
        def run(*args, **kwargs):
            with phase(name):
                return original(*args, **kwargs)
        return run
    return make


def _step_start(original, forward: str | None = None):
    """execute_model: begins the step's record (the whole call in phase `forward`
    when it is the runner's forward, as V2's)."""
    def execute_model(self, scheduler_output, *args, **kwargs):
        _recorder.begin(scheduler_output)
        try:
            with phase(forward) if forward else nullcontext():
                out = original(self, scheduler_output, *args, **kwargs)
        except BaseException:
            _recorder.end()
            raise
        if getattr(self, "execute_model_state", None) is None:  # no sample_tokens follows
            _recorder.end()
        return out
    return execute_model


def _step_finish(original):
    def sample_tokens(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            _recorder.end()
    return sample_tokens
