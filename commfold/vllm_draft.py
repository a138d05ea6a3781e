"""commfold in vLLM's speculative-decoding drafter (installed by the vLLM plugin in
every vLLM process when COMMFOLD_VLLM=1).

The drafter's model graph is compiled by vLLM and rewritten by commfold's pass like
the target's (all-reduce + RMSNorm fusions, the final norm's included; a small
vocab-parallel embedding replicated). Its greedy token pick runs eagerly, once per
draft step: ``SpecDecodeBaseProposer._greedy_sample`` calls
``compute_logits(hidden).argmax(-1)``, a full-vocab all-gather per step (EAGLE-3 with
a draft vocab smaller than the target's scatters it into the target vocab first).
With commfold the pick is ``draft_top_tokens`` (commfold.vllm_top_tokens): the head
replicated when its full weight is under the size rule, else a per-rank argmax and
one (value, index) pair per row per rank, then the d2t remap where there is one.

With ``use_local_argmax_reduction`` vLLM calls the drafter's own ``get_top_tokens``
(its hand-written path), and commfold leaves it alone; a drafter without one gets
``draft_top_tokens`` instead of vLLM refusing to start. Drafters that constrain their
logits to another tokenizer's vocab (``use_heterogeneous_vocab``) keep vLLM's pick.
Which passes the pick may use follows COMMFOLD_PASSES (replicate_vocab_parallel,
local_argmax; neither: vLLM's pick).
"""
from __future__ import annotations

import logging

from .config import Config

log = logging.getLogger("commfold")

PICK_PASSES = ("replicate_vocab_parallel", "local_argmax")


def pick_config(config: Config) -> Config | None:
    """`config` restricted to the passes a draft pick can use (None: none of them)."""
    passes = tuple(p for p in config.passes if p in PICK_PASSES)
    return config.replace(passes=passes) if passes else None


def choose_pick(proposer, config: Config | None):
    """commfold's draft pick for `proposer` (a vLLM SpecDecodeBaseProposer), or None
    where vLLM's own pick runs (see the module docstring)."""
    from .vllm_top_tokens import draft_top_tokens

    model = getattr(proposer, "model", None)
    if (config is None or getattr(proposer, "use_heterogeneous_vocab", False)
            or getattr(proposer, "use_local_argmax_reduction", False)
            or not callable(getattr(model, "compute_logits", None))):
        return None
    log.info("commfold: draft tokens of %s picked without a full-vocab gather (%s)",
             type(model).__name__, "+".join(config.passes))
    return draft_top_tokens(model, config)


def hook_proposers(config: Config) -> None:
    """Patch vLLM's draft proposers (idempotent): the greedy draft pick, and a
    get_top_tokens for drafters without one under use_local_argmax_reduction."""
    from vllm.v1.spec_decode import draft_model, llm_base_proposer

    from .vllm_top_tokens import install_get_top_tokens

    chosen = pick_config(config)
    base = llm_base_proposer.SpecDecodeBaseProposer
    original_sample = base.__dict__.get("_greedy_sample")
    if original_sample is not None and not getattr(original_sample, "_commfold", False):
        def _greedy_sample(self, hidden_states, _original=original_sample):
            pick = self.__dict__.get("_commfold_pick", _UNSET)
            if pick is _UNSET:
                pick = self._commfold_pick = choose_pick(self, chosen)
            return _original(self, hidden_states) if pick is None else pick(hidden_states)

        _greedy_sample._commfold = True
        base._greedy_sample = _greedy_sample

    for cls in (base, draft_model.DraftModelProposer):
        original = cls.__dict__.get("_get_model")
        if original is None or getattr(original, "_commfold", False):
            continue

        def _get_model(self, _original=original):
            model = _original(self)
            if getattr(self, "use_local_argmax_reduction", False):
                install_get_top_tokens(model, chosen)
            return model

        _get_model._commfold = True
        cls._get_model = _get_model


_UNSET = object()
