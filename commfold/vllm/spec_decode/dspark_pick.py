"""DSpark's greedy draft block (Model Runner V2's ``DSparkSpeculator._sample_sequential``)
without the full-vocab gather of its base draft logits.

vLLM computes the base draft logits of the block's positions with one vocab gather,
then, position by position, adds the Markov bias of the previous token (full vocab on
every rank: the head is replicated, by vLLM or commfold.vllm.spec_decode.eager_heads) and takes
the argmax. Here vLLM's own loop runs with three callees swapped for the block:
``compute_draft_logits`` gives this rank's shard (the processor's gather as the
identity: commfold.vllm.target.logits_head), ``markov_bias`` its shard's columns of the bias,
and ``_sample_logits`` picks with commfold.ops.local_argmax (one (value, index) pair
per row per rank) before vLLM's ``map_draft_to_target``. Adding the bias and scaling
are elementwise, so each shard holds the gathered row's values; the first maximum
over ranks is the first over the row (ties to the lowest id). NaN: 0.32/0.33 pick
with ``argmax`` (a NaN wins, the first one), 0.34 with ``greedy_argmax`` (NaN as
-inf: masked on the shard first).

Position i's bias reads position i-1's token, so the exchanges are one per position
and cannot be folded into one for the block exactly. The cost table
(commfold.cost, DSPARK_PICK) weighs those exchanges against the one gather, per block
from the request count, positions, vocab and communicator: the same on every rank.

vLLM's block runs, said once per reason, where the pick would not be vLLM's or the
full logits are read: probabilistic drafting, top-k Markov sampling, an acceptance
estimator, a drafter with its own sequential kernels or an output transform, a
soft-capped processor, a head commfold does not find, a method source not checked.
"""
from __future__ import annotations

import logging

import torch

from commfold.config import Config
from commfold.vllm.compat import hook_points, pins, releases
from commfold.vllm.observe import step_log

log = logging.getLogger("commfold")

_DSPARK = "vllm.v1.worker.gpu.spec_decode.dspark.speculator:DSparkSpeculator"
# the methods the swapped block runs through, as commfold read them (whole sources)
HOOK_POINTS = tuple((f"{_DSPARK}.{name}", pins.pinned(f"{_DSPARK}.{name}"))
                    for name in ("_sample_sequential", "_sample_logits"))
# 0.34's loop body, where the class has it (its _sample_sequential calls it)
MARKOV_CHAIN = (f"{_DSPARK}._sample_markov_chain",
                pins.pinned(f"{_DSPARK}._sample_markov_chain"))
# _sample_logits's greedy line -> whether NaN counts as -inf
PICK_LINES = {"draft_ids = logits.argmax(dim=-1)": False,
              "draft_ids = greedy_argmax(logits)": True}


def unread() -> list[str]:
    """The points of this vLLM commfold has not read ([]: the hook may run); 0.34's
    loop body is one of them from 0.34 (releases.here)."""
    points = HOOK_POINTS + ((MARKOV_CHAIN,) if releases.here().at_least("0.34.0") else ())
    return hook_points.missing(points)


def nan_as_neginf() -> bool:
    """Whether DSpark's greedy line counts NaN as -inf (PICK_LINES): 0.34's, whose
    ``_sample_logits`` is pinned with it."""
    return releases.here().at_least("0.34.0")


def why_vllm(spec, head) -> str | None:
    """Why this block stays vLLM's, or None. Reads the speculator's config and the
    drafter's classes only: the same on every rank."""
    if getattr(spec, "draft_logits", None) is not None:
        return "probabilistic drafting: vLLM's Gumbel sampler reads the full draft logits"
    if getattr(spec, "_draft_topk", None) is not None:
        return "top-k Markov sampling (dspark_draft_topk)"
    if getattr(spec, "acceptance_estimator", None) is not None:
        return "adaptive verification's acceptance estimator reads the full draft logits"
    model = spec.model
    for own in ("sample_sequential", "apply_output_logit_transform"):
        if hasattr(model, own):
            return f"its drafter {type(model).__name__} has its own {own}"
    if isinstance(head, str):
        return head
    if head.processor.soft_cap is not None:
        return "soft-capped draft logits (vLLM's eager tanh on the gathered row)"
    return None


def find_head(model):
    """The drafter's LogitsHead, or why there is none (a str)."""
    from commfold.ops.local_argmax import SUPPORTED_DTYPES
    from commfold.vllm.target.logits_head import LogitsHead

    head, why = LogitsHead.of(model, lora=False, pipeline=False)
    if head is None:
        return f"no vocab-parallel head found ({why})"
    w2 = getattr(getattr(getattr(model, "model", None), "markov_head", None), "markov_w2", None)
    if getattr(w2, "org_vocab_size", None) != head.vocab:
        return f"its Markov bias is not over the draft vocab ({head.vocab})"
    if head.layer.weight.dtype not in SUPPORTED_DTYPES:
        return f"logits in {head.layer.weight.dtype}"
    return head


class Block:
    """One block's swapped callees (set on the instances, removed after). Where the
    drafter's compute_draft_logits gives no shard (logged by LogitsHead; the same on
    every rank) the block runs vLLM's callees, gather included."""

    def __init__(self, spec, head, nan: bool):
        from vllm.distributed import get_tp_group

        self.spec, self.model, self.head, self.nan = spec, spec.model, head, nan
        self.lo = get_tp_group().rank_in_group * head.shard
        self.logits = self.model.compute_draft_logits  # vLLM's (bound)
        self.bias = self.model.markov_bias
        self.sample = spec._sample_logits
        self.exchanges, self.whole = 0, False

    def __enter__(self):
        self.model.compute_draft_logits = self.shard_logits
        self.model.markov_bias = self.shard_bias
        self.spec._sample_logits = self.pick
        return self

    def __exit__(self, *exc):
        del self.model.compute_draft_logits, self.model.markov_bias
        del self.spec._sample_logits

    def shard_logits(self, hidden):
        shard = self.head.local_logits(hidden, compute=self.logits)
        if shard is None:
            self.whole = True
            return self.logits(hidden)
        return shard

    def shard_bias(self, embed):
        bias = self.bias(embed)
        if self.whole:
            return bias
        if bias.shape[-1] != self.head.vocab:  # find_head checked the layer: not reached
            raise RuntimeError(f"commfold: DSpark's Markov bias is {tuple(bias.shape)}, "
                               f"not over the draft vocab {self.head.vocab}")
        cols = bias[..., self.lo:self.lo + self.head.shard]
        pad = self.head.shard - cols.shape[-1]  # the last rank's padding: masked by the pick
        return torch.nn.functional.pad(cols, (0, pad)) if pad else cols

    def pick(self, logits, idx_map, sample_pos, step, bias=None):
        from commfold.ops.local_argmax import local_argmax
        from commfold.shard.payload import nan_as_neg_inf

        if self.whole:
            return self.sample(logits, idx_map, sample_pos, step, *(
                () if bias is None else (bias,)))
        if bias is not None:  # vLLM fuses it in its sampler only when drafting randomly
            raise RuntimeError("commfold: DSpark's fused Markov bias in a greedy block")
        if self.nan:
            logits = nan_as_neg_inf(logits)
        _, index = local_argmax(logits.contiguous(), self.head.vocab, self.head.comm)
        self.exchanges += 1
        return self.model.map_draft_to_target(index)


_said: set = set()
_classes: dict = {}  # speculator class -> (points not read, NaN rule)


def _say(cls, why: str) -> None:
    if (cls.__name__, why) not in _said:
        _said.add((cls.__name__, why))
        log.info("commfold: %s's draft block is vLLM's pick, with its full-vocab gather: %s",
                 cls.__name__, why)


def block_plan(spec, num_reqs: int, hidden: torch.Tensor):
    """(head, NaN rule) for commfold's block pick, or None (said once per class and
    reason; the step log notes it)."""
    from commfold.vllm.target import pick_cost

    cls = type(spec)
    if cls not in _classes:
        gone = unread()
        _classes[cls] = (gone, not gone and nan_as_neginf())
    gone, nan = _classes[cls]
    if gone:
        why: str | None = f"vLLM changed {gone[0]}"
    else:
        head = spec.__dict__.get("_commfold_head")
        if head is None:
            head = spec._commfold_head = find_head(spec.model)
        why = why_vllm(spec, head)
    if why:
        _say(cls, why)
    else:  # per block, noted in the step log only
        why = pick_cost.slower_block(num_reqs, spec.num_speculative_steps, hidden.dtype,
                                     hidden.device.type, head.comm, head.vocab, head.world)
    if why:
        step_log.note("draft_pick", f"vLLM ({why})")
        return None
    return head, nan


def hook(config: Config | None, key: str) -> bool:
    """Wrap DSparkSpeculator._sample_sequential (idempotent; hook_points.wrap with the
    installing hook's `key`, so its uninstall undoes it); True when installed. One line
    says so, or why not."""
    if config is None or "local_argmax" not in config.passes:
        log.info("commfold: DSpark's draft block keeps vLLM's pick (local_argmax is not "
                 "among the passes)")
        return False
    cls = hook_points.resolve(_DSPARK)
    if key in hook_points.wrapped_by(cls.__dict__["_sample_sequential"]):
        return True
    gone = unread()
    if gone:
        log.info("commfold: DSpark's draft block keeps vLLM's pick: vLLM changed %s", gone[0])
        return False

    def make(original):
        def _sample_sequential(self, num_reqs, head_hidden, *args, **kwargs):
            with step_log.phase("drafting"):
                plan = block_plan(self, num_reqs, head_hidden)
                if plan is None:
                    return original(self, num_reqs, head_hidden, *args, **kwargs)
                with Block(self, *plan) as block:
                    out = original(self, num_reqs, head_hidden, *args, **kwargs)
                step_log.note("draft_pick", "vLLM (no logits shard)" if block.whole else
                              f"commfold ({block.exchanges} pair exchanges)")
                return out
        return _sample_sequential

    hook_points.wrap(cls, "_sample_sequential", make, key)
    log.info("commfold: DSpark's greedy draft block picks from each rank's vocab shard "
             "(one (value, index) exchange per position, no full-vocab gather)")
    return True
