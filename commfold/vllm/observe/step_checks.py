"""Checks over an engine run's step logs (commfold.vllm.observe.step_log, read with
commfold.distributed.comm_log.read_step_logs): what tests and examples assert about
the target pick."""
from __future__ import annotations

from commfold.distributed.comm_log import StepLog

LOCAL_PICKS = ("greedy", "verify", "logprobs")


def target_pick_problems(by_rank: dict[int, list[StepLog]], vocab_shard: int,
                         phases: tuple[str, ...] = ("logits", "sampling")) -> list[str]:
    """What contradicts commfold's target pick in an engine run's step logs
    (empty when all is well): a spec-decode step (spec_tokens > 0) not verified
    locally ("verify"), or a step the pick took ("greedy" / "verify" / "logprobs")
    that still gathered rows `vocab_shard` wide in `phases`; also no local step at
    all. vocab_shard: the target's padded vocab / TP."""
    problems, local = [], 0
    for rank, steps in sorted(by_rank.items()):
        for s in steps:
            pick = s.info.get("target_pick")
            if s.info.get("spec_tokens") and pick != "verify":
                problems.append(f"rank {rank} step {s.step}: spec decode step picked by {pick}")
            if pick in LOCAL_PICKS:
                local += 1
                wide = s.in_phase(*phases).vocab_gathers(vocab_shard)
                if wide:
                    problems.append(f"rank {rank} step {s.step} ({pick}): vocab-wide "
                                    f"gathers {[(e.name, e.shapes, e.phase) for e in wide]}")
    if not local:
        problems.append("no step was picked locally (COMMFOLD_VLLM=1 set? "
                        "COMMFOLD_TARGET_PICK=0?)")
    return problems
