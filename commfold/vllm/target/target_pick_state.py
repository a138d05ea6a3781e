"""The target's token pick on vLLM 0.34's Model Runner V2, through the extension
points V2 declares for it (``vllm/v1/worker/gpu/model_states/interface.py``):

- ``ModelState.custom_sampler(sampler)``, called once after load: commfold returns
  (its Sampler, its RejectionSampler) - vLLM's own, built as the runner builds them,
  each behind a proxy that reads and writes through to it and takes over only the
  steps commfold picks;
- ``ModelState.compute_sample_logits(hidden)``, called per step in
  ``GPUModelRunner.sample``: on a step commfold picks, this rank's logits shard
  (the model's ``compute_logits_local`` where it has one, else commfold.vllm.
  logits_head's head with the processor's gather as the identity) in place of the
  all-gathered logits; on any other step vLLM's own.

The decision (commfold.vllm.target.decision.decide_v2 via commfold.vllm.target.v2_pick.decide_step:
a pure function of the step's sampling parameters, the same on every rank) is made
before the logits exist, in a wrapper around the state's ``preprocess_state(input_batch,
...)`` (V2's hook on every real batch before the forward). ``sample`` then applies the
structured-output grammar bitmask to what compute_sample_logits returned: V2's
``StructuredOutputsWorker.apply_grammar_bitmask`` is wrapped so that, given a shard
commfold returned, it masks the shard's columns with the bitmask re-packed for them
(commfold.vllm.sample.shard_grammar). A batch is decided as structured from
``has_structured_output_reqs`` (which vLLM's scheduler sets for every step it gives a
grammar bitmask); a bitmask reaching the shard of a batch decided otherwise decides it
again, and a step that then stays vLLM's is gathered and masked by V2's method on the
full row. The proxies know the shard by identity: any other logits (vLLM's dummy
sampler run, a step left to vLLM) go to vLLM's sampler untouched; a shard reaching
them with another batch than the one decided on (a context-parallel batch restored
for sampling) is gathered and given to vLLM.

Acts only where the model's state keeps the base methods: a state class that
overrides ``compute_sample_logits`` or ``custom_sampler`` (a diffusion state), a
model with its own ``get_model_state_cls``, batch-sharded sampling (its all-to-all
computes the logits before any state method) and watermarking are left alone, with
one line naming the class. ``ModelState.__init__`` is wrapped only to say so for
every state built (there is no extension point for that).

NaN: V2's target pick is its Gumbel kernel at temperature 0 (``gumbel_sample``): per
1024-column block Triton's max with indices, then the first NaN block wins, else the
first block holding the maximum (torch.argmax's rule, as its combine kernel says);
``greedy_argmax`` (NaN as -inf) is the drafters' pick, not the target's. commfold
gives any step whose gathered maxima hold NaN to V2's samplers on the gathered logits,
so the token is V2's whatever its kernels do with NaN (commfold.vllm.target.v2_pick).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

from commfold.vllm.compat import hook_points, pins
from commfold.vllm.target import pick_cost, v2_pick
from commfold.vllm.sample import shard_grammar
from commfold.vllm.observe import step_log
from commfold.vllm.target.switch import paused
from commfold.vllm.target.logits_head import LogitsHead

log = logging.getLogger("commfold")

_STATE = "vllm.v1.worker.gpu.model_states.interface:ModelState"
_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_SAMPLER = "vllm.v1.worker.gpu.sample.sampler:Sampler"
_REJECT = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
_SINCE = (0, 34)  # the releases this set covers (target_pick_v2.HOOK_SETS): their pins
HOOK_POINTS = (
    # the extension points, and where the runner calls them
    (f"{_STATE}.custom_sampler", "return None"),
    (f"{_STATE}.compute_sample_logits",
     "return cast(Any, self.model).compute_logits(hidden_states)"),
    (f"{_STATE}.preprocess_state", None),
    (f"{_RUNNER}.load_model", "custom = self.model_state.custom_sampler(self.sampler)"),
    (f"{_RUNNER}.load_model", "self.sampler, self.rejection_sampler = custom"),
    (f"{_RUNNER}.load_model", "self.rejection_sampler = RejectionSampler("),
    (f"{_RUNNER}.load_model", "if self.vllm_config.watermark_config is None:"),
    (f"{_RUNNER}.execute_model", "self.model_state.preprocess_state("),
    ("vllm.v1.worker.gpu.sample.batch_shard:batch_sharded_sampling_enabled", None),
    # the path the shard takes from the state to the samplers: read whole
    (f"{_RUNNER}.sample", pins.pinned(f"{_RUNNER}.sample", since=_SINCE)),
    # the functions whose result commfold returns in their place: read whole
    *((where, pins.pinned(where, since=_SINCE)) for where in (
        f"{_SAMPLER}.__call__", f"{_SAMPLER}.sample", f"{_SAMPLER}._sample_random",
        f"{_REJECT}:RejectionSampler.__call__", f"{_REJECT}:RejectionSampler._verify")),
    # what the pick's exactness rests on inside V2's kernels and helpers
    ("vllm.v1.worker.gpu.sample.gumbel:gumbel_noised_argmax",
     "return tl.max(logits, axis=0, return_indices=True)"),
    ("vllm.v1.worker.gpu.sample.gumbel:_gumbel_combine_kernel",
     "tl.where(mask & (values == maximum), block, PADDED_NUM_BLOCKS), axis=0"),
    ("vllm.model_executor.layers.logits_processor:LogitsProcessor._get_logits",
     "if skip_gather:\n            return logits"),
) + v2_pick.PICK_POINTS

KEY = "target pick (V2 model state)"  # its wrappers' mark (hook_points.wrap)


def install() -> None:
    """Wrap the base ModelState's __init__, custom_sampler and compute_sample_logits
    (once per process; a state class's own override is never touched)."""
    from vllm.v1.worker.gpu.model_states.interface import ModelState

    for name, make in (("__init__", _init), ("custom_sampler", _custom_sampler),
                       ("compute_sample_logits", _compute_sample_logits)):
        hook_points.wrap(ModelState, name, make, KEY)
    try:  # where it moved, structured steps keep vLLM's logits (shard_grammar.refusal)
        from vllm.v1.worker.gpu.structured_outputs import StructuredOutputsWorker

        hook_points.wrap(StructuredOutputsWorker, "apply_grammar_bitmask", _grammar, KEY)
    except (ImportError, AttributeError):
        log.info("commfold: V2's StructuredOutputsWorker.apply_grammar_bitmask not found")


def uninstall() -> None:
    """Undo install() (tests: vLLM's own methods back on the base class)."""
    hook_points.unwrap_hook(KEY)


def _base(name: str):
    from vllm.v1.worker.gpu.model_states.interface import ModelState

    return ModelState.__dict__[name]


def refusal(state) -> str | None:
    """Why commfold leaves this model state's sampling alone (None: it may act): the
    same on every rank (classes and engine config)."""
    from vllm.v1.worker.gpu.sample.batch_shard import batch_sharded_sampling_enabled

    cls, model = type(state), state.model
    overrides = [name for name in ("compute_sample_logits", "custom_sampler")
                 if getattr(cls, name) is not _base(name)]
    if overrides:
        return f"{cls.__name__} overrides {' and '.join(overrides)}"
    if hasattr(model, "get_model_state_cls"):
        return f"{type(model).__name__} brings its own model state ({cls.__name__})"
    if getattr(state.vllm_config, "watermark_config", None) is not None:
        return "watermarking (its sampler reads the full row)"
    if batch_sharded_sampling_enabled(state.vllm_config, model):
        return ("batch-sharded sampling: its all-to-all computes the logits in place of "
                "compute_sample_logits")
    return None


def _init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        why = refusal(self)
        if why is not None:
            log.info("commfold: target pick off for this model: %s", why)
            v2_pick.note_head(self.model, None)
    return __init__


@dataclass
class _Step:
    batch: object  # the InputBatch decided on
    mode: str | None
    why: str


_picks: weakref.WeakSet = weakref.WeakSet()  # every StatePick (the bitmask's wrapper)


class StatePick:
    """One model state's pick: its head, vLLM's samplers, this step's decision."""

    def __init__(self, head: LogitsHead, sampler, rejection_sampler, spec_config):
        self.head, self.sampler, self.rejection_sampler = head, sampler, rejection_sampler
        self.spec_config = spec_config
        self.decided: _Step | None = None  # preprocess_state -> compute_sample_logits
        self.shard = None  # (tensor, step): compute_sample_logits -> the samplers
        self.given_back = None  # the step's masked full logits where grammar() gave it up
        _picks.add(self)

    def decide(self, input_batch) -> None:
        if self.head is None:
            return
        if paused():
            mode, why = None, "paused"
        else:
            mode, why = v2_pick.decide_step(
                self.sampler, self.rejection_sampler, self.spec_config, input_batch,
                structured=bool(input_batch.has_structured_output_reqs),
                vocab=self.head.vocab)
        self.decided = _Step(input_batch, mode, why)

    def logits(self, hidden, vllms):
        """This rank's shard on a step decided for commfold, else vllms()."""
        step, self.decided, self.shard = self.decided, None, None
        self.given_back = None
        if self.head is None:
            mode, why = None, "no target pick head for this model"
        elif step is None:
            mode, why = None, "no decision for this step"
        elif hidden.shape[0] != step.batch.logits_indices.shape[0]:
            mode, why = None, "the rows sampled are not the batch's logits rows"
        else:
            mode, why = step.mode, step.why
        # the cost table, from the step's shape (every rank alike)
        mode, why = pick_cost.gate(mode, why, hidden.shape[0], hidden, self.head)
        step_log.note("target_pick", mode or f"vLLM ({why})")
        if mode is None:
            return vllms()
        shard = self.head.local_logits(hidden)
        if shard is None:  # logged; every rank alike, and for good
            v2_pick.note_head(self.head.model, None)
            self.head = None
            return vllms()
        self.shard = (shard, step)
        return shard

    def grammar(self, apply_bitmask, input_batch, request_ids, bitmask) -> None:
        """V2's grammar bitmask (apply_bitmask: V2's method) on the held shard
        (commfold.vllm.sample.shard_grammar). A batch not decided as structured is decided
        again with it; a step that then stays vLLM's is gathered here and masked by
        V2's method as V2 masks it, for vLLM's samplers (every rank alike)."""
        shard, step = self.shard
        if not step.batch.has_structured_output_reqs:
            mode, why = v2_pick.decide_step(self.sampler, self.rejection_sampler,
                                            self.spec_config, step.batch, structured=True,
                                            vocab=self.head.vocab)
            if mode is None:
                self.given_back = self.head.gather(shard)
                apply_bitmask(self.given_back, input_batch, request_ids, bitmask)
                self.shard = (shard, _Step(step.batch, None, why))
                return
        shard_grammar.apply(apply_bitmask, self.head, shard, input_batch, request_ids,
                            bitmask)

    def sample(self, logits, input_batch, vllms, draft_logits=None):
        """The SamplerOutput for `logits`: commfold's when they are the shard of the
        step decided on, else vllms(full logits). draft_logits: the DraftLogitsCache
        the runner gives V2's RejectionSampler (None for the Sampler)."""
        held, self.shard = self.shard, None
        full, self.given_back = self.given_back, None
        if held is None or logits is not held[0]:
            return vllms(logits)
        shard, step = held
        if full is not None:  # given up with the grammar bitmask (grammar())
            step_log.note("target_pick", f"vLLM ({step.why})")
            return vllms(full)
        if input_batch is not step.batch:
            step_log.note("target_pick", "vLLM (another batch than the one decided on)")
            return vllms(self.head.gather(shard))
        with step_log.phase("sampling"):
            return v2_pick.pick(self.sampler, self.rejection_sampler, self.head, shard,
                                input_batch, step.mode, vllms, draft_logits)


class _Proxy:
    """vLLM's sampler behind commfold's call: every attribute read and written is
    vLLM's object's (the runner, its speculator and warmup use them)."""
    __slots__ = ("_commfold_inner", "_commfold_pick")

    def __init__(self, inner, pick: StatePick):
        object.__setattr__(self, "_commfold_inner", inner)
        object.__setattr__(self, "_commfold_pick", pick)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_commfold_inner"), name)

    def __setattr__(self, name, value):
        setattr(self._commfold_inner, name, value)

    def __repr__(self):
        return f"commfold({self._commfold_inner!r})"


class TargetSampler(_Proxy):
    """V2's Sampler, commfold's pick on the steps it takes."""
    __slots__ = ()

    def __call__(self, logits, input_batch, *args, **kwargs):
        inner = self._commfold_inner
        return self._commfold_pick.sample(
            logits, input_batch, lambda full: inner(full, input_batch, *args, **kwargs))


class TargetRejectionSampler(TargetSampler):
    """V2's RejectionSampler, commfold's verification on the steps it takes (called
    with whatever arguments this release's runner passes: the same call; its
    ``draft_logits``, the drafter's cache, reaches the sampled verification)."""
    __slots__ = ()

    def __call__(self, logits, input_batch, *args, **kwargs):
        inner = self._commfold_inner
        draft_logits = args[0] if args else kwargs.get("draft_logits")
        return self._commfold_pick.sample(
            logits, input_batch, lambda full: inner(full, input_batch, *args, **kwargs),
            draft_logits)


def _custom_sampler(original):
    def custom_sampler(self, sampler):
        custom = original(self, sampler)
        if custom is not None or refusal(self) is not None:  # said at __init__
            return custom
        head, why = LogitsHead.of(self.model, lora=self.vllm_config.lora_config,
                                  pipeline=self.vllm_config.parallel_config
                                  .pipeline_parallel_size > 1, logits_local=True)
        v2_pick.note_head(self.model, head)
        if head is None:
            log.info("commfold: target pick off for this model: %s", why)
            return custom
        if type(sampler).__name__ != "Sampler":
            log.info("commfold: target pick off for this model: sampler %s (commfold "
                     "knows V2's Sampler)", type(sampler).__name__)
            return custom
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

        spec = self.vllm_config.speculative_config
        # built as GPUModelRunner.load_model builds it when no state overrides it
        rejection = RejectionSampler(sampler, spec, self.device) if spec is not None \
            else None
        pick = StatePick(head, sampler, rejection, spec)
        _watch_batches(self, pick)
        log.info("commfold: target pick through %s's sampler: %s's shard of [rows, %d] "
                 "from %s", type(self).__name__, type(self.model).__name__, head.vocab,
                 "compute_logits_local" if head.logits_local else "compute_logits")
        return (TargetSampler(sampler, pick),
                TargetRejectionSampler(rejection, pick) if rejection is not None else None)
    return custom_sampler


def _watch_batches(state, pick: StatePick) -> None:
    """The state's preprocess_state (whatever its class defines) also decides the
    step for the batch it is given."""
    def make(original):
        def preprocess_state(input_batch, *args, **kwargs):
            out = original(input_batch, *args, **kwargs)
            pick.decide(input_batch)
            return out
        return preprocess_state

    hook_points.wrap(state, "preprocess_state", make, KEY)
    state._commfold_pick = pick


def _compute_sample_logits(original):
    def compute_sample_logits(self, hidden_states):
        pick = self.__dict__.get("_commfold_pick")
        if pick is None:
            return original(self, hidden_states)
        return pick.logits(hidden_states, lambda: original(self, hidden_states))
    return compute_sample_logits


def _grammar(original):
    def apply_grammar_bitmask(self, logits, input_batch, grammar_req_ids, grammar_bitmask,
                              *args, **kwargs):
        pick = next((p for p in list(_picks)
                     if p.shard is not None and p.shard[0] is logits), None)
        if pick is None:  # vLLM's logits
            return original(self, logits, input_batch, grammar_req_ids, grammar_bitmask,
                            *args, **kwargs)
        pick.grammar(lambda shard, batch, ids, mask: original(self, shard, batch, ids, mask,
                                                              *args, **kwargs),
                     input_batch, grammar_req_ids, grammar_bitmask)
    return apply_grammar_bitmask


def hook_points_missing() -> list[str]:
    return hook_points.missing(HOOK_POINTS)
