"""The collective log sees what really runs in a vLLM TP=2 group: vLLM CPU's
shared-memory ops (which never reach a c10d backend), its gloo fallback, and
commfold's own ops on either - each collective once, with this rank's shapes, dtype
and bytes. And the engine-step recorder (commfold.vllm_comm_log) writes one line per
step with each collective's phase (outermost phase wins: a LogitsProcessor call
inside drafting is drafting), read back by read_step_logs. The engine itself is
covered in test_vllm_engine.py (no engine start here)."""
from __future__ import annotations

import pytest
import torch

from vllm_models import init_vllm_tp, require_vllm, shm_supported

require_vllm()


def _seen(shm: bool, log_dir: str):
    from types import SimpleNamespace

    from commfold import vllm_comm_log
    from commfold.ops.local_argmax import local_argmax
    from commfold.testing import record_collectives
    from commfold.testing.vllm_tp import shm_handle

    tp = init_vllm_tp(2, shm=shm)
    comm = f"vllm_shm:{shm_handle(tp)}" if shm else f"vllm:{tp.unique_name}"
    x = torch.randn(4, 10)
    with record_collectives() as log:
        tp.all_gather(x, dim=-1)
        tp.all_reduce(x.clone())
        tp.gather(x.to(torch.bfloat16), dst=0, dim=-1)
        local_argmax(x, 19, comm)  # one gather of a (value, index) int64 pair per row
    events = [(e.name, e.shapes, e.dtype, e.bytes) for e in log.events]

    # the step recorder, driven as the runner wrappers drive it
    rec = vllm_comm_log._recorder = vllm_comm_log._StepRecorder(log_dir)
    try:
        for step in range(2):
            rec.begin(SimpleNamespace(total_num_scheduled_tokens=7 + step,
                                      num_scheduled_tokens={"a": 4, "b": 3 + step},
                                      scheduled_spec_decode_tokens={"a": [1, 2]}))
            with vllm_comm_log.phase("forward"):
                tp.all_reduce(x.clone())
            with vllm_comm_log.phase("logits"):
                tp.all_gather(x, dim=-1)
            vllm_comm_log.note("target_pick", f"note {step}")
            tp.all_reduce(x[:1].clone())  # outside every phase: "other"
            with vllm_comm_log.phase("drafting"):
                with vllm_comm_log.phase("logits"):
                    local_argmax(x, 19, comm)
            rec.end()
        rec.end()  # no open step: nothing written
    finally:
        vllm_comm_log._recorder = None
    return {"events": events, "rank": tp.rank_in_group}


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_collectives_seen_once_with_phases(vllm_ranks, shm, tmp_path):
    if shm and not shm_supported():
        pytest.skip("vLLM's kernel build for this CPU (AVX2) has no shared-memory communicator")
    from commfold.testing.comm_log import read_step_logs

    results = vllm_ranks.run(_seen, shm, str(tmp_path))
    # shm sends non-float data bit-cast as float32: an int64 pair is 4 float32
    pair = ((4, 4), "float") if shm else ((4, 2), "long int")
    for res in results:
        assert res["events"] == [("all_gather", ((4, 10),), "float", 160),
                                 ("all_reduce", ((4, 10),), "float", 160),
                                 ("gather", ((4, 10),), "c10::BFloat16", 80),
                                 ("all_gather", (pair[0],), pair[1], 64)], res

    logs = read_step_logs(tmp_path)
    assert sorted(logs) == [0, 1]
    for rank, steps in logs.items():
        assert [s.step for s in steps] == [0, 1]
        for s in steps:
            assert s.rank == rank
            assert s.info["tokens"] == 7 + s.step and s.info["requests"] == 2
            assert s.info["spec_tokens"] == 2 and s.info["target_pick"] == f"note {s.step}"
            assert [(e.name, e.phase) for e in s.events] == [
                ("all_reduce", "forward"), ("all_gather", "logits"),
                ("all_reduce", "other"), ("all_gather", "drafting")], s.events
            assert s.in_phase("logits").vocab_gathers(10) == s.of("all_gather")[:1]
            assert s.in_phase("drafting").vocab_gathers(10) == []  # the pair exchange
            assert s.in_phase("drafting").bytes() == 64
