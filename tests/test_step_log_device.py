"""The step log counts collectives of vLLM's CUDA communicator (PyNccl, custom
all-reduce: no profiler event of their own), tested on 2 gloo ranks with a stand-in
communicator of the same shape: each marked collective once, with what it sends and
the phase it ran in, a torch.distributed fallback inside it not counted twice; and
the methods it marks exist in every vLLM release whose sources are at hand."""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from commfold.vllm.observe import step_log as vllm_comm_log

_COMMUNICATOR = "distributed/device_communicators/cuda_communicator.py"


class StandInCommunicator:
    """vLLM's CudaCommunicator's collective methods: all_reduce as PyNccl's (nothing a
    profiler sees: the sum is formed by hand), all_gather falling back to
    torch.distributed (a gloo event inside the marked span)."""

    def all_reduce(self, x):
        return x * dist.get_world_size()

    def all_gather(self, x, dim=0):
        out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    def send(self, tensor, dst=None):
        return None


def step_on_rank(directory: str):
    cls = type("Communicator", (), dict(StandInCommunicator.__dict__))  # its own methods
    vllm_comm_log.wrap_device_communicator(cls)
    comm = cls()
    before = comm.all_reduce(torch.ones(2, 3))  # no step recorded: runs as it was
    vllm_comm_log._recorder = recorder = vllm_comm_log._StepRecorder(directory)
    try:
        recorder.begin(SimpleNamespace(total_num_scheduled_tokens=3,
                                       num_scheduled_tokens={"a": 3}))
        with vllm_comm_log.phase("forward"):
            reduced = comm.all_reduce(torch.ones(3, 8, dtype=torch.bfloat16))
        with vllm_comm_log.phase("sampling"):
            gathered = comm.all_gather(torch.full((3, 5), float(dist.get_rank())))
        comm.send(torch.ones(4), 1 - dist.get_rank())
        recorder.end()
    finally:
        vllm_comm_log._recorder = None
    line = (Path(directory) / f"rank{dist.get_rank()}.jsonl").read_text().splitlines()[-1]
    return (before.sum().item(), reduced.sum().item(), gathered[:, 0].tolist(),
            json.loads(line)["events"])


def test_device_communicator_collectives_are_logged_once(ranks2, tmp_path):
    for before, reduced, gathered, events in ranks2.run(step_on_rank, str(tmp_path)):
        assert (before, reduced) == (12.0, 48.0)  # results unchanged by the marks
        assert gathered == [0.0] * 3 + [1.0] * 3
        assert [(e["kind"], e["shapes"], e["dtype"], e["bytes"], e["phase"]) for e in events] \
            == [("all_reduce", [[3, 8]], "c10::BFloat16", 48, "forward"),
                ("all_gather", [[3, 5]], "float", 60, "sampling"),
                ("send", [[4]], "float", 16, "other")]


def _sources() -> list[Path]:
    """vLLM source roots at hand: the installed vLLM (found, not imported) and every
    claimed release's sources from its wheel (harness.vllm_sources)."""
    roots = []
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        roots.append(Path(list(spec.submodule_search_locations)[0]))
    from harness import vllm_sources

    return roots + vllm_sources.claimed_trees()


def test_marked_methods_exist_in_vllms_cuda_communicator():
    roots = [r for r in _sources() if (r / _COMMUNICATOR).exists()]
    if not roots:
        import pytest

        pytest.skip("no vLLM sources here")
    module, _, name = vllm_comm_log.DEVICE_COMMUNICATOR.partition(":")
    assert module.replace(".", "/") + ".py" == "vllm/" + _COMMUNICATOR
    for root in roots:
        tree = ast.parse((root / _COMMUNICATOR).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        defined = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
        assert set(vllm_comm_log.DEVICE_METHODS) <= defined, (root, defined)


class StandInPyNccl:
    """vLLM's PyNcclCommunicator's signatures (the output first, what this rank sends
    second), sending over gloo; ``disabled`` as PyNccl's (nothing sent)."""

    disabled = False

    def all_gather(self, output_tensor, input_tensor, stream=None):
        if not self.disabled:
            dist.all_gather_into_tensor(output_tensor, input_tensor)

    def all_to_all_single(self, output_tensor, input_tensor, output_split_sizes,
                          input_split_sizes, stream=None):
        if not self.disabled:
            dist.all_to_all_single(output_tensor, input_tensor, output_split_sizes,
                                   input_split_sizes)


def pynccl_step_on_rank(directory: str):
    cls = type("PyNcclCommunicator", (), dict(StandInPyNccl.__dict__))
    vllm_comm_log.wrap_pynccl(cls)
    outer = type("Communicator", (), dict(StandInCommunicator.__dict__))
    vllm_comm_log.wrap_device_communicator(outer)
    nccl, off, comm = cls(), cls(), outer()
    off.disabled = True
    rank = dist.get_rank()
    vllm_comm_log._recorder = recorder = vllm_comm_log._StepRecorder(directory)
    try:
        recorder.begin(SimpleNamespace(total_num_scheduled_tokens=2,
                                       num_scheduled_tokens={"a": 2}))
        with vllm_comm_log.phase("sampling"):  # batch-sharded sampling's exchange
            recv = torch.empty(4, 6)
            nccl.all_to_all_single(recv, torch.full((4, 6), float(rank)), [2, 2], [2, 2])
        gathered = torch.empty(6, 2, dtype=torch.bfloat16)  # DSpark's sharded all_gather
        nccl.all_gather(gathered, torch.full((3, 2), float(rank), dtype=torch.bfloat16))
        off.all_gather(torch.empty(6, 2), torch.ones(3, 2))  # disabled: sends nothing
        comm.all_gather(torch.ones(2, 5))  # the communicator's own: counted once
        recorder.end()
    finally:
        vllm_comm_log._recorder = None
    line = (Path(directory) / f"rank{rank}.jsonl").read_text().splitlines()[-1]
    return recv[:, 0].tolist(), gathered[:, 0].tolist(), json.loads(line)["events"]


def test_pynccl_direct_calls_are_logged_once(ranks2, tmp_path):
    for recv, gathered, events in ranks2.run(pynccl_step_on_rank, str(tmp_path)):
        assert recv == [0.0, 0.0, 1.0, 1.0]  # results unchanged by the marks
        assert gathered == [0.0] * 3 + [1.0] * 3
        assert [(e["kind"], e["shapes"], e["dtype"], e["phase"]) for e in events] == [
            ("all_to_all", [[4, 6]], "float", "sampling"),
            ("all_gather", [[3, 2]], "c10::BFloat16", "other"),
            ("all_gather", [[2, 5]], "float", "other")]


def test_pynccl_methods_send_what_the_step_log_reads():
    """Each release's PyNccl methods name the tensor they send as the log reads it."""
    roots = [r for r in _sources() if (r / _PYNCCL).exists()]
    if not roots:
        import pytest

        pytest.skip("no vLLM sources here")
    for root in roots:
        path = root / _PYNCCL
        tree = ast.parse(path.read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                   and n.name == "PyNcclCommunicator")
        params = {f.name: [a.arg for a in f.args.args][1:] for f in cls.body
                  if isinstance(f, ast.FunctionDef)}
        for method, (_, sent) in vllm_comm_log.PYNCCL_METHODS.items():
            if method in params:
                assert sent in params[method], (path, method, params[method])
        assert {"all_reduce", "all_gather", "send"} <= set(params), path


_PYNCCL = "distributed/device_communicators/pynccl.py"
