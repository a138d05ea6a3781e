"""Greedy token selection over vLLM's vocab-parallel LM head without gathering logits.

vLLM computes logits and the greedy argmax eagerly, outside its compiled model graph,
so commfold's graph passes never see them. Here ``compute_logits -> argmax`` is
compiled with the commfold backend: its local_argmax pass turns "all-gather the
logits, slice off the vocab padding, argmax" into a per-rank argmax plus one gather
of (value, index) pairs, on the same communicator vLLM used (shared memory, gloo or
vLLM's custom ops). Bit for bit the same token as the full gather, ties included.

A soft-capped head (``LogitsProcessor.soft_cap``) keeps vLLM's eager pick, gather
included, with one log line: vLLM computes its tanh eagerly (ATen's), and compiled
code computes it as Inductor tiles the kernel (Sleef or libm), which differ in the
last bits; the pick would then not be vLLM's.

Draft proposers with ``use_local_argmax_reduction`` call ``model.get_top_tokens`` and
refuse a drafter that lacks it; ``install_get_top_tokens`` supplies this one (the
vLLM plugin does so when COMMFOLD_VLLM=1). ``draft_top_tokens`` is the pick for any
drafter, EAGLE-3's smaller draft vocab included (see RemappedPick). Nothing here
imports vLLM.
"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch

from commfold.backend import backend
from commfold.config import Config
from commfold.shard.payload import nan_as_neg_inf
from commfold.vllm.target.nan_pick import MaskBeforeGather

log = logging.getLogger("commfold")

LOCAL_ARGMAX = Config(passes=("local_argmax",))
_picks = 0  # picks built in this process


def top_tokens_fn(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                  config: Config | None = None, values: bool = False,
                  nan_as_neginf: bool = False) -> Callable:
    """hidden states [T, H] -> greedy token ids [T] (int64): ``argmax`` of
    ``compute_logits(hidden)`` over the vocab, compiled with commfold (dynamic T);
    with ``values`` the pair (max value, argmax) of ``max(dim=-1)``; with
    ``nan_as_neginf`` over the logits with NaN as -inf (vLLM 0.34's greedy_argmax;
    commfold.vllm.target.nan_pick keeps it local). A compute_logits
    commfold cannot rewrite still runs correctly, with the gather (the report says
    why). The compiled pick does not re-check the modules' attributes (soft cap,
    scale, weight shapes) on each call: build a new one after changing them."""

    def greedy(hidden: torch.Tensor):
        logits = compute_logits(hidden)
        if nan_as_neginf:
            logits = nan_as_neg_inf(logits)
        return tuple(logits.max(dim=-1)) if values else logits.argmax(dim=-1)

    # Dynamo keeps compiled code per code object and stops compiling one after its
    # recompile limit (then runs it eagerly: the gather back, silently): every pick
    # gets a code object of its own, so one process may hold many (drafters, tests)
    global _picks
    _picks += 1
    greedy = types.FunctionType(greedy.__code__.replace(co_name=f"greedy_{_picks}"),
                                greedy.__globals__, greedy.__name__, greedy.__defaults__,
                                greedy.__closure__)

    # A pick runs once per draft token, so its fixed cost counts at batch 1. Guards:
    # those on the hidden states stay (shape, dtype, device); those on the LM head's
    # and logits processor's attributes go - vLLM never changes them after loading,
    # and vLLM compiles its own models with no Dynamo guards at all (~0.1 ms a call).
    compiled = torch.compile(greedy, backend=backend(config=config or LOCAL_ARGMAX), dynamic=True,
                             options={"guard_filter_fn":
                                      torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    dynamo_config, inductor_config = torch._dynamo.config, torch._inductor.config

    def top_tokens(hidden: torch.Tensor) -> torch.Tensor:
        # Float attributes (logit scale, soft cap) as constants, not graph inputs: the
        # pass must see their sign to know the ops keep the argmax. Set directly, not
        # with config.patch (~140 us a call, this pick's largest fixed cost).
        # Ints too: under dynamic=True an int reaching the graph through a closure
        # (a multi-module MTP drafter's spec_step_idx) would be symbolic, and a drafter
        # that names its module with str() of it (DeepSeek's MTP) would break the graph
        # between the gather and the argmax
        was = dynamo_config.specialize_float, dynamo_config.specialize_int
        dynamo_config.specialize_float = dynamo_config.specialize_int = True
        try:
            return compiled(hidden)
        finally:
            dynamo_config.specialize_float, dynamo_config.specialize_int = was

    def top_tokens_nan(hidden: torch.Tensor) -> torch.Tensor:
        pre = inductor_config.post_grad_custom_pre_pass  # what a compile in it runs
        inductor_config.post_grad_custom_pre_pass = MaskBeforeGather(pre)
        try:
            return top_tokens(hidden)
        finally:
            inductor_config.post_grad_custom_pre_pass = pre

    if nan_as_neginf:
        return top_tokens_nan

    return top_tokens


def soft_capped(logits_processor, who: str) -> bool:
    """True (and a log line) when the processor soft-caps its logits."""
    cap = getattr(logits_processor, "soft_cap", None)
    if cap is None:
        return False
    log.info("commfold: %s keeps vLLM's greedy pick and its full-vocab gather: its logits "
             "are soft-capped (tanh %.4g), whose last bits compiled code does not "
             "reproduce", who, cap)
    return True


def lm_head_top_tokens(logits_processor, lm_head, config: Config | None = None):
    """The greedy pick of vLLM's ``LogitsProcessor`` over a ``ParallelLMHead``: the
    drop-in for ``logits_processor.get_top_tokens(lm_head, hidden)``."""
    if soft_capped(logits_processor, type(lm_head).__name__):
        return lambda h: logits_processor(lm_head, h).argmax(dim=-1)
    return top_tokens_fn(lambda h: logits_processor(lm_head, h), config)


class RemappedPick:
    """The greedy pick of a drafter whose vocab is a subset of the target's (vLLM's
    EAGLE-3 ``draft_id_to_target_id``, "d2t": draft id k is target id k + d2t[k]).

    vLLM's ``compute_logits`` scatters the draft logits into a row of the target
    vocab filled with -inf and the pick is its argmax: a full-vocab gather, then a
    scatter no graph pass sees through. Here the pick is ``pick(hidden)`` - (max, first
    argmax) over the draft vocab, compiled with local_argmax - then the remap. That
    is the argmax of the scattered row exactly when the remap is strictly increasing
    (draft order is target order: the first maximum is the same column, NaN
    included), and a row whose maximum is -inf maps to 0, the argmax of an all -inf
    row. The remap is checked on every call (d2t is replicated: the same data and
    decision on every rank; vLLM recomputes it per call too); one that is not
    strictly increasing or leaves the target vocab takes ``fallback`` (vLLM's own
    ``compute_logits(hidden).argmax(-1)``), logged once."""

    def __init__(self, d2t: torch.Tensor, target_vocab: int, pick: Callable,
                 fallback: Callable[[torch.Tensor], torch.Tensor], nan_as_neginf: bool = False):
        self.d2t, self.target_vocab = d2t, target_vocab
        self.pick, self.fallback, self.nan_as_neginf = pick, fallback, nan_as_neginf
        self._warned = False

    def targets(self) -> torch.Tensor | None:
        t = torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t.reshape(-1)
        if t.numel() and bool((t[1:] > t[:-1]).all()) and 0 <= t[0] and t[-1] < self.target_vocab:
            return t
        if not self._warned:
            self._warned = True
            log.warning("commfold: the draft-to-target vocab map is not strictly increasing "
                        "within the target vocab; the draft pick gathers the full logits")
        return None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        targets = self.targets()
        if targets is None:
            logits = self.fallback(hidden)
            return (nan_as_neg_inf(logits) if self.nan_as_neginf else logits).argmax(dim=-1)
        value, index = self.pick(hidden)
        token = targets[index]
        return torch.where(value == float("-inf"), torch.zeros_like(token), token)


def draft_top_tokens(model, config: Config | None = None, nan_as_neginf: bool = False,
                     **logits_kwargs) -> Callable:
    """The greedy draft pick of a vLLM drafter, as target-vocab ids: ``compute_logits
    -> argmax`` compiled with commfold, or for a drafter with a smaller draft vocab
    (``draft_id_to_target_id``) the local pick over its own logits plus the remap.
    `logits_kwargs` go to every ``compute_logits`` call (a multi-module MTP drafter's
    ``spec_step_idx``: the head of that step's module); `nan_as_neginf`: NaN logits
    count as -inf (vLLM 0.34's greedy_argmax), else they win (``argmax``)."""
    d2t = getattr(model, "draft_id_to_target_id", None)

    def compute_logits(h):
        return model.compute_logits(h, **logits_kwargs)

    if soft_capped(getattr(model, "logits_processor", None), f"the drafter {type(model).__name__}"):
        if nan_as_neginf:
            return lambda h: nan_as_neg_inf(compute_logits(h)).argmax(dim=-1)
        return lambda h: compute_logits(h).argmax(dim=-1)
    if d2t is None:
        return top_tokens_fn(compute_logits, config, nan_as_neginf=nan_as_neginf)
    lp, head = model.logits_processor, model.lm_head
    pick = top_tokens_fn(lambda h: lp(head, h), config, values=True,
                         nan_as_neginf=nan_as_neginf)
    return RemappedPick(d2t, int(model.config.vocab_size), pick, compute_logits,
                        nan_as_neginf)


class StepPicks:
    """A drafter's ``get_top_tokens(hidden_states, spec_step_idx=None)`` with vLLM's
    signature: one ``draft_top_tokens`` per draft step index it is called with (a
    multi-module MTP drafter picks with that step's module's head; the speculator
    passes the index, ``model.compute_logits`` takes it), built on first use. Without
    an index, the pick of ``compute_logits(hidden)``."""

    def __init__(self, model, config: Config | None = None, nan_as_neginf: bool = False):
        self.model, self.config, self.nan_as_neginf = model, config, nan_as_neginf
        self.picks: dict[int | None, Callable] = {}

    def __call__(self, hidden_states: torch.Tensor, spec_step_idx: int | None = None):
        pick = self.picks.get(spec_step_idx)
        if pick is None:
            kwargs = {} if spec_step_idx is None else {"spec_step_idx": spec_step_idx}
            pick = self.picks[spec_step_idx] = draft_top_tokens(
                self.model, self.config, self.nan_as_neginf, **kwargs)
        return pick(hidden_states)


def install_get_top_tokens(model, config: Config | None = None,
                           nan_as_neginf: bool = False) -> bool:
    """Give `model` a ``get_top_tokens(hidden_states, spec_step_idx=None)``
    (``StepPicks``) if it has none; True when one was installed. The model's class is
    not modified."""
    if callable(getattr(model, "get_top_tokens", None)):
        return False
    if not callable(getattr(model, "compute_logits", None)):
        raise TypeError(f"commfold: {type(model).__name__} has no compute_logits() "
                        "to build get_top_tokens from")
    model.get_top_tokens = StepPicks(model, config, nan_as_neginf)
    return True
