"""What commfold runs and with which thresholds.

A Config is part of the pass's cache key (CommfoldPass.uuid), so two compiles with
different configs never share a cached graph.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from commfold.cost import DEFAULT_REPLICATE_MAX_BYTES, DEFAULT_TWO_SHOT_MIN_BYTES

# The pass registry: every pass, in the order they run; each is the module of the
# same name in passes/ (its run(ctx): commfold.passes.PASSES, loaded on first use).
# Order matters: replication first (it removes a vocab-parallel embedding's all-reduce
# outright, better than fusing it into the next norm), then the fusion, then the
# readers of gathers replication left sharded: softmax statistics first (they take
# a row's greedy picks along), then top-k, then plain greedy picks.
ALL_PASSES = ("replicate_vocab_parallel", "fuse_allreduce_rmsnorm", "local_softmax_stats",
              "local_topk", "local_argmax")


FUSED_SAMPLER_STEPS = ("vllm", "gumbel")  # Config.fused_sampler_steps' choices


def unknown_passes(names) -> list[str]:
    """The names in `names` that are no registered pass."""
    return [p for p in names if p not in ALL_PASSES]


@dataclass(frozen=True)
class Config:
    """Options of commfold's passes.

    passes: which passes run, in this order (see ``ALL_PASSES``).
    replicate_max_bytes: a vocab-parallel embedding / LM head whose FULL weight is at
        most this many bytes is replicated on every rank (no per-step collective).
    replicate_head_max_bytes: LM heads only, a tighter bound for speed (a replicated
        head reads its full weight each step): None takes the limit measured for the
        head's device (commfold.cost's REPLICATE_HEAD limit; replicate_max_bytes where
        none was measured).
    strict: raise on an internal pass error instead of leaving the graph unchanged
        (for tests; users keep the default so a compile never breaks).
    extra: free-form (key, value) pairs that only enter the cache key (tests use a
        nonce to force a fresh compile).
    two_shot_min_bytes: the fused all-reduce + RMSNorm runs two-shot (reduce-scatter,
        add + norm on the local rows, all-gather) on c10d groups for tensors of at
        least this many bytes whose rows divide by the world size; -1: never (the
        default, measured: commfold.cost).
    fuse_cost_rule: leave an all-reduce + RMSNorm site unfused where the fused op
        was measured slower than the unfused program (sizes, dtypes and communicators
        in commfold.cost's FUSE rule); False fuses every site it can.
    fused_sampler_steps: vLLM's target pick (Model Runner V2) of a sampled step that
        vLLM would draw with a fused top-k / top-p sampler (FlashInfer's on GPUs:
        unseeded, no greedy request): "vllm" (the default) leaves it to vLLM;
        "gumbel" draws it from the shards on V2's Gumbel path - equal in
        distribution and reproducible by seed, not the tokens FlashInfer draws.
    """

    passes: tuple[str, ...] = ALL_PASSES
    # the measured defaults: commfold.cost
    replicate_max_bytes: int = DEFAULT_REPLICATE_MAX_BYTES.value
    replicate_head_max_bytes: int | None = None
    strict: bool = False
    extra: tuple[tuple[str, str], ...] = field(default=())
    two_shot_min_bytes: int = DEFAULT_TWO_SHOT_MIN_BYTES.value
    fuse_cost_rule: bool = True
    fused_sampler_steps: str = "vllm"

    def __post_init__(self):
        passes = (self.passes,) if isinstance(self.passes, str) else tuple(self.passes)
        unknown = unknown_passes(passes)
        if unknown:
            raise ValueError(
                f"commfold: unknown pass name(s) {unknown}; choose from {list(ALL_PASSES)}"
            )
        object.__setattr__(self, "passes", passes)
        if self.replicate_max_bytes < 0:
            raise ValueError("commfold: replicate_max_bytes must be >= 0")
        if self.replicate_head_max_bytes is not None and self.replicate_head_max_bytes < 0:
            raise ValueError("commfold: replicate_head_max_bytes must be >= 0 or None "
                             "(the measured limit for the head's device)")
        if self.fused_sampler_steps not in FUSED_SAMPLER_STEPS:
            raise ValueError(f"commfold: fused_sampler_steps must be one of "
                             f"{FUSED_SAMPLER_STEPS}, not {self.fused_sampler_steps!r}")
        if self.two_shot_min_bytes < -1:
            raise ValueError("commfold: two_shot_min_bytes must be >= -1 (-1: never)")

    def key(self) -> str:
        """A stable text form, part of the cache key."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)
