"""The cost table: every rule about speed that commfold's passes and vLLM hooks
apply, and every number those rules read, in one place.

One question: ``why_slower(site)`` is None where a rewrite is not measured slower at
``site``, else the reason (a pass records it as the site's near-miss, a hook logs it).
A ``Site`` is what is decided: the rule, the device kind, the communicator the
rewritten code would run, the dtype, and the size (bytes, or rows / vocab / world for
a per-step choice). The answer depends on the site and the config only, never on
timing or free memory: every rank decides the same.

``TABLE`` holds the numbers, keyed by (rule, device kind, communicator, element size),
each naming the results file or page it was measured in; the measurements and their
stories are in docs/performance.md and benchmarks/results/, never in code comments.
Config fields whose defaults are measured (``replicate_max_bytes``,
``two_shot_min_bytes``) take them from the ``DEFAULT_*`` values here, and a
recognizer's size bound from its ``Measured`` value here (``LOCAL_TOPK_MAX_K``). A
rule's number changes here and nowhere else.

Adding a rule:
1. Name what is decided: a constant below, e.g. ``TARGET_PICK = "vllm_target_pick"``.
2. Put its numbers in ``TABLE``: ``Key(rule, device, comm, itemsize)`` -> ``Limit``
   (``least``: slower below so many bytes; ``most``: slower above; ``never``: slower at
   every size), ``measured_in`` naming the file. A key field left ``ANY`` matches every
   site; where several keys match, the one with the most fields set wins. No key
   matching means: not measured slower, the rewrite is taken.
3. Write its check, ``(site, limit, config) -> str | None`` (limit: the matched
   ``Limit`` or None), and add it to ``CHECKS`` under the rule's name. A reason holds
   no rank-local value (it enters the report's rank-consistency fingerprint).
4. At the decision, build ``Site(rule, device, comm, dtype, nbytes=..., rows=...,
   vocab=..., world=...)`` from shapes and the config only, and use
   ``why_slower(site, config)`` as the near-miss / log reason.
5. Tell the measurement (command, machine, table) in docs/performance.md, with its
   figures in the results file ``measured_in`` names.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from commfold.config import Config
    from commfold.distributed.collectives import Communicator

ANY = None

# What is decided (Site.rule)
FUSE = "fuse_allreduce_rmsnorm"  # the fused all-reduce + RMSNorm op, or the unfused program
REPLICATE_HEAD = "replicate_lm_head"  # an LM head on a replicated full weight, or sharded
# an LM head read only by a greedy pick: replicated, or left sharded to local_argmax
REPLICATE_BEFORE_ARGMAX = "replicate_lm_head_before_argmax"
# V2's batch-sharded sampling (an all-to-all of vocab shards) or commfold's local pick
BATCH_SHARDED_PICK = "vllm_batch_sharded_pick"
# vLLM's token picks, per engine step: commfold's local pick from the logits shard (one
# (value, index) pair per row per rank: the target's greedy pick and greedy
# verification, the drafter's pick) or vLLM's all-gather of the logits, then its own
LOCAL_PICK = "vllm_local_pick"
# the same with top-k logprobs: two small exchanges (local_logprobs) against the gather
LOCAL_LOGPROBS = "vllm_local_logprobs"
# Model Runner V2's sampled steps from the shards (the draw, sampled verification):
# up to three small exchanges (min_p's maxima, the top-k / top-p bounds, the pair) or more
# with logprobs, against the gather
SAMPLED_PICK = "vllm_sampled_pick"
# DSpark's greedy draft block: one (value, index) exchange per position from the base
# logits' shard (commfold.vllm.spec_decode.dspark_pick) or vLLM's one gather of the block's logits
DSPARK_PICK = "vllm_dspark_pick"

# Communicators (Site.comm): what moves the data in the rewritten code
SHM = "vllm_shm"  # vLLM CPU's shared-memory all-reduce
GLOO = "gloo"  # a c10d group whose backend for the device is gloo
VLLM = "vllm"  # vLLM's own all-reduce op (it chooses shm or gloo at run time)
FLASHINFER = "flashinfer"  # FlashInfer's fused all-reduce + add + RMSNorm (CUDA)
# the fused op's fallback on FlashInfer's devices without FlashInfer: the graph's
# collective, then eager ops
COMPOSITE = "composite"


@dataclass(frozen=True)
class Site:
    """One decision, described by what a cost rule may read."""

    rule: str
    device: str = "cpu"  # the tensors' torch device type
    comm: str = ""  # one of the communicators above, or a c10d backend's name
    dtype: torch.dtype | None = None
    nbytes: int = 0  # the bytes the rule weighs: the least a symbolic size can be,
    # or for a pick what vLLM's gather sends per rank (rows x vocab shard x itemsize)
    rows: int = 0  # per-step choices: rows of logits,
    vocab: int = 0  # the full vocab,
    world: int = 0  # and the tensor-parallel world size
    exchanges: int = 1  # the rewrite's collectives per decision (a DSpark block's positions)

    @property
    def itemsize(self) -> int | None:
        return self.dtype.itemsize if self.dtype is not None else None


@dataclass(frozen=True)
class Key:
    rule: str
    device: str | None = ANY
    comm: str | None = ANY
    itemsize: int | None = ANY

    def matches(self, site: Site) -> bool:
        return self.rule == site.rule and all(
            want is ANY or want == got for want, got in (
                (self.device, site.device), (self.comm, site.comm),
                (self.itemsize, site.itemsize)))

    def fields_set(self) -> int:
        return sum(f is not ANY for f in (self.device, self.comm, self.itemsize))


@dataclass(frozen=True)
class Limit:
    """Where a rewrite was measured slower: below ``least`` bytes, above ``most``, or
    at every size (``never``). ``figure``: the measurement in a few words, for the
    reason; ``measured_in``: the file it comes from."""

    measured_in: str
    least: int = 0
    most: int | None = None
    never: bool = False
    figure: str = ""


@dataclass(frozen=True)
class Measured:
    """A number a recognizer or a Config default reads, and where it was measured."""

    value: int
    measured_in: str


_FUSE_SHM = "docs/performance.md, \"The fused norm's cost rule\" (shared memory)"
_FUSE_GLOO = "docs/performance.md, \"The fused norm's cost rule\" (gloo)"
_REPLICATE = "benchmarks/results/results.md, `replicate`"
_PICK_CPU = "benchmarks/results/target_pick_rule.md"
_DSPARK_CPU = "benchmarks/results/dspark_pick.md"
# not commfold's measurement: an estimate from published NCCL figures on H100 NVLink
# (SGLang's bench_symm.sh, nccl-tests#212), benchmarks/gpu_estimate.py, until the GPU check
_PICK_CUDA = "docs/performance.md, \"GPU estimate: what the bytes are worth\""

TABLE: dict[Key, Limit] = {
    Key(FUSE, "cpu", SHM, 4): Limit(_FUSE_SHM, least=256 << 10),
    Key(FUSE, "cpu", SHM, 2): Limit(_FUSE_SHM, least=2 << 20),
    Key(FUSE, "cpu", GLOO, 2): Limit(
        _FUSE_GLOO, never=True,
        figure="measured up to 28% slower (from 128 KiB) and at most 5% faster"),
    Key(FUSE, ANY, COMPOSITE): Limit("docs/gpu-check.md", never=True,
                                     figure="0.72x, H200, bf16, T=64, H=4096"),
    Key(REPLICATE_HEAD, "cpu"): Limit(_REPLICATE, most=8 << 20),
    Key(REPLICATE_BEFORE_ARGMAX): Limit(
        "docs/performance.md, \"Replication limits\" (bench_replicate --layers head+argmax)",
        most=4 << 20),
    # the greedy pick (one exchange) measured faster than vLLM's gather at every size on
    # the CPU communicators: no CPU entry; top-k logprobs (two exchanges) lose at a row
    # or two
    Key(LOCAL_LOGPROBS, "cpu", SHM): Limit(_PICK_CPU, least=1 << 20,
                                           figure="slower or even up to 4 rows"),
    Key(LOCAL_LOGPROBS, "cpu", GLOO): Limit(_PICK_CPU, least=512 << 10,
                                            figure="slower or even up to 2 rows"),
    # DSpark's block: one exchange per position against one gather; `least` is the
    # gathered bytes per rank per exchange below which the gather was not slower
    Key(DSPARK_PICK, "cpu", SHM): Limit(_DSPARK_CPU, least=2 << 10,
                                        figure="0.91-1.10x at 1 KiB per exchange"),
    Key(DSPARK_PICK, "cpu", GLOO): Limit(_DSPARK_CPU, least=64 << 10,
                                         figure="0.25-0.86x up to 32000 B per exchange"),
    # estimated, eager NCCL on H100 / H200 NVLink (benchmarks/gpu_estimate.py): the
    # greedy pick's one exchange is never dearer than the one gather it replaces (no
    # entry); top-k logprobs' two exchanges (2 x 14.57 us) cost more than a gather below
    # 128 KiB + 11.0 us at 370 GB/s per rank (TP=2, the most; fewer bytes at TP=4 / 8)
    Key(LOCAL_LOGPROBS, "cuda"): Limit(_PICK_CUDA, least=4_201_072,
                                       figure="estimated from published H100 NCCL figures"),
    # a sampled step's three exchanges against the gather: equal at 128 KiB + 25.6 us at
    # 370 GB/s per rank (TP=2; a step with logprobs makes more: not told apart)
    Key(SAMPLED_PICK, "cuda"): Limit(_PICK_CUDA, least=9_591_972,
                                     figure="estimated from published H100 NCCL figures"),
    # DSpark's block: each exchange 14.57 us, worth 5.39 MB of gather at 370 GB/s (TP=2)
    Key(DSPARK_PICK, "cuda"): Limit(_PICK_CUDA, least=5_390_900,
                                    figure="estimated from published H100 NCCL figures, "
                                    "per exchange"),
}

# A replicated embedding was faster at every size measured: its limit is memory and
# the one-time build, not speed.
DEFAULT_REPLICATE_MAX_BYTES = Measured(64 << 20, _REPLICATE)
# Two-shot (reduce-scatter, local add + norm, all-gather) was slower than one-shot at
# every size measured on gloo: -1, never.
DEFAULT_TWO_SHOT_MIN_BYTES = Measured(-1, "docs/performance.md, \"Two-shot\"")
# FlashInfer's fusion: the largest call handed to it when vLLM's own table has no
# entry for the GPU (not measured: a size within that table's entries).
DEFAULT_FLASHINFER_MAX_BYTES = Measured(2 << 20, "not measured (vLLM's table's range)")
# The largest k local_topk takes: k (key, value) pairs per row per rank stay small
# against the gathered row at the k measured; larger k was not measured.
LOCAL_TOPK_MAX_K = Measured(64, "benchmarks/results/results.md, `sampling` (top-8, top-50)")


def limit_for(site: Site) -> Limit | None:
    """The most specific TABLE entry that matches `site`, or None."""
    found = [k for k in TABLE if k.matches(site)]
    return TABLE[max(found, key=Key.fields_set)] if found else None


def why_slower(site: Site, config: Config | None = None) -> str | None:
    """Why the rewrite would be slower at `site` than the program it replaces, or None.
    `config` supplies the limits a user set (Config fields); None: the defaults."""
    check = CHECKS[site.rule]
    return check(site, limit_for(site), config)


def comm_name(comm: Communicator, device_type: str) -> str:
    """Site.comm for a collective's communicator: vLLM CPU's shared memory, vLLM's
    own op, or the c10d group's backend for the device (the same on every rank)."""
    from commfold.distributed.collectives import CommKind

    if comm.kind is CommKind.C10D:
        return comm.backend(device_type) or CommKind.C10D.value
    return comm.kind.value


# ---- the checks ------------------------------------------------------------------

FUSE_RULE_OFF = ("(docs/performance.md; Config(fuse_cost_rule=False) or "
                 "COMMFOLD_FUSE_COST_RULE=0 fuses it)")


def _fuse(site: Site, limit: Limit | None, config: Config | None) -> str | None:
    if limit is None:
        return None
    if site.comm == COMPOSITE:
        return (f"cost rule: on {site.device} without FlashInfer's fused all-reduce "
                "the op runs its composite path (the all-reduce, then eager ops), "
                f"measured slower than plain Inductor ({limit.figure}: "
                f"{limit.measured_in}) {FUSE_RULE_OFF}")
    if limit.never:
        return (f"cost rule: a {site.dtype} site on {site.comm}, where the fused op "
                f"{limit.figure} {FUSE_RULE_OFF}")
    if site.nbytes >= limit.least:
        return None
    return (f"cost rule: {site.nbytes} bytes (its smallest size) is below {limit.least} "
            "on vLLM CPU's shared-memory all-reduce, where the fused op is slower in "
            f"{site.dtype} {FUSE_RULE_OFF}")


def head_limit(config: Config | None, device_type: str) -> tuple[int, str]:
    """The largest LM head replicated on `device_type`, and what sets it (for the
    report): the config's replicate_head_max_bytes when set, else the measured limit
    for the device, within replicate_max_bytes either way (None: Config's defaults,
    which are this table's; commfold.config imports this module, not the reverse)."""
    head_max = config.replicate_head_max_bytes if config is not None else None
    most = config.replicate_max_bytes if config is not None \
        else DEFAULT_REPLICATE_MAX_BYTES.value
    if head_max is not None:
        if head_max < most:
            return head_max, "replicate_head_max_bytes"
        return most, "replicate_max_bytes"
    measured = limit_for(Site(REPLICATE_HEAD, device_type))
    if measured is not None and measured.most is not None and measured.most < most:
        return measured.most, f"the measured {device_type} head limit (replicate_head_max_bytes)"
    return most, "replicate_max_bytes"


def _replicate_head(site: Site, limit: Limit | None, config: Config | None) -> str | None:
    most, name = head_limit(config, site.device)
    return f"full weight {site.nbytes} B > {name} {most} B" if site.nbytes > most else None


def _replicate_before_argmax(site: Site, limit: Limit | None, config: Config | None
                             ) -> str | None:
    if limit is None or limit.most is None or site.nbytes <= limit.most:
        return None
    return (f"greedy pick follows: left to local_argmax (full weight {site.nbytes} B > "
            f"{limit.most} B, where a shard read + pair gather beats a full-weight read)")


def pick_bytes(rows: int, tp: int) -> int:
    """Bytes each rank receives for commfold's pick: one (value, index) pair, 16 B,
    per row from every other rank."""
    return rows * (tp - 1) * 16


def all_to_all_bytes(rows: int, vocab: int, tp: int, itemsize: int) -> int:
    """Bytes each rank receives under V2's batch-sharded sampling: its rows' logits
    (about rows / tp of them) from every other rank's vocab shard."""
    return -(-rows // tp) * (vocab // tp) * (tp - 1) * itemsize


def _batch_sharded_pick(site: Site, limit: Limit | None, config: Config | None
                        ) -> str | None:
    """Bytes moved, not a measurement: the pick's pairs against the all-to-all."""
    ours = pick_bytes(site.rows, site.world)
    theirs = all_to_all_bytes(site.rows, site.vocab, site.world, site.itemsize or 0)
    if ours >= theirs:
        return f"batch-sharded sampling moves less ({theirs} B < {ours} B)"
    return None


def pick_site(rule: str, device: str, comm: str, dtype: torch.dtype, rows: int, vocab: int,
              world: int) -> Site:
    """The Site of one engine step's pick: `rows` rows of logits over `vocab` tokens
    sharded `world` ways (what vLLM's gather would send, per rank, is its nbytes)."""
    shard = -(-vocab // world)
    return Site(rule, device, comm, dtype, nbytes=rows * shard * dtype.itemsize, rows=rows,
                vocab=vocab, world=world)


def _local_pick(site: Site, limit: Limit | None, config: Config | None) -> str | None:
    if limit is None or site.nbytes >= limit.least:
        return None
    return (f"cost rule: {site.rows} row(s) of logits ({site.nbytes} B per rank) are "
            f"below {limit.least} B on {site.device} {site.comm or ''}, where vLLM's "
            f"gather is faster ({limit.figure}: {limit.measured_in})")


def dspark_site(device: str, comm: str, dtype: torch.dtype, reqs: int, positions: int,
                vocab: int, world: int) -> Site:
    """The Site of one DSpark draft block: vLLM gathers reqs x positions rows of base
    logits once; commfold exchanges `reqs` pairs once per position."""
    site = pick_site(DSPARK_PICK, device, comm, dtype, reqs * positions, vocab, world)
    return Site(site.rule, device, comm, dtype, nbytes=site.nbytes, rows=site.rows,
                vocab=vocab, world=world, exchanges=positions)


def _dspark_pick(site: Site, limit: Limit | None, config: Config | None) -> str | None:
    """Slower where the gather avoided is under ``least`` bytes per exchange made."""
    if limit is None or site.nbytes >= limit.least * site.exchanges:
        return None
    return (f"cost rule: a DSpark block's gather of {site.nbytes} B per rank is below "
            f"{limit.least} B per exchange x {site.exchanges} exchanges on {site.device} "
            f"{site.comm}, where vLLM's one gather was not slower ({limit.figure}: "
            f"{limit.measured_in})")


CHECKS: dict[str, Callable[[Site, Limit | None, Config | None], str | None]] = {
    FUSE: _fuse,
    REPLICATE_HEAD: _replicate_head,
    REPLICATE_BEFORE_ARGMAX: _replicate_before_argmax,
    BATCH_SHARDED_PICK: _batch_sharded_pick,
    LOCAL_PICK: _local_pick,
    LOCAL_LOGPROBS: _local_pick,
    SAMPLED_PICK: _local_pick,
    DSPARK_PICK: _dspark_pick,
}
