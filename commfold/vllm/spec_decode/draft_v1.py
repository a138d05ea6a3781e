"""The greedy draft pick in the V1 model runner's proposers (installed by the vLLM
plugin with commfold.vllm.spec_decode.draft).

The drafter's model graph is compiled by vLLM and rewritten by commfold's pass like
the target's (all-reduce + RMSNorm fusions, the final norm's included; a small
vocab-parallel embedding replicated). Its greedy token pick runs eagerly, once per
draft step: ``SpecDecodeBaseProposer._greedy_sample`` calls
``compute_logits(hidden).argmax(-1)``, a full-vocab all-gather per step (EAGLE-3 with
a draft vocab smaller than the target's scatters it into the target vocab first).
With commfold the pick is ``draft_top_tokens`` (commfold.vllm.spec_decode.top_tokens): the head
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

from commfold.config import Config
from commfold.vllm.compat import hook_points
from commfold.vllm.spec_decode.draft_choice import PICK, TOP_TOKENS, choose_pick, slower
from commfold.vllm.spec_decode.speculators import V1_PROPOSERS, pick_note

log = logging.getLogger("commfold")

_BASE = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
# what vLLM's proposers must still say for each hook to be right (see hook_points)
HOOK_POINTS = {
    PICK: ((f"{_BASE}._greedy_sample",
            "return self.model.compute_logits(hidden_states).argmax(dim=-1)"),),
    TOP_TOKENS: ((f"{_BASE}._greedy_sample", "return self.model.get_top_tokens(hidden_states)"),
                 (f"{_BASE}.load_model", "self.model = self._get_model()"),
                 (f"{_BASE}._get_model", None),
                 ("vllm.v1.spec_decode.draft_model:DraftModelProposer._get_model", None)),
}


def v1_pick_note(proposer, local: bool) -> str:
    """The line a V1 proposer's load logs: whose pick its draft tokens are."""
    name = type(proposer).__name__
    if local:
        return (f"{name} drafts with use_local_argmax_reduction: the drafter's "
                "get_top_tokens picks")
    if getattr(proposer, "use_heterogeneous_vocab", False):
        return (f"{name}'s draft tokens are vLLM's pick: its drafter's logits are "
                "constrained to another tokenizer's vocab (use_heterogeneous_vocab)")
    return pick_note(type(proposer), V1_PROPOSERS)[1]


def hook(chosen: Config | None, pick: bool, top_tokens: bool) -> None:
    """V1's proposers: the greedy draft pick in _greedy_sample (and whose pick a
    proposer runs, said at its drafter's load), get_top_tokens given to a drafter
    without one at its load."""
    from vllm.v1.spec_decode import draft_model, llm_base_proposer

    from commfold.vllm.spec_decode.top_tokens import install_get_top_tokens

    base = llm_base_proposer.SpecDecodeBaseProposer
    loaders = [c for c in (base, draft_model.DraftModelProposer) if "_get_model" in vars(c)]
    if pick:
        def greedy(original):
            def _greedy_sample(self, hidden_states):
                pick = self.__dict__.get("_commfold_pick", _UNSET)
                if pick is _UNSET:
                    pick = self._commfold_pick = choose_pick(self, chosen)
                if pick is not None and slower(self, hidden_states):
                    pick = None
                return original(self, hidden_states) if pick is None else pick(hidden_states)
            return _greedy_sample

        def noted(original):
            def _get_model(self):
                model = original(self)
                if not self.__dict__.get("_commfold_noted"):
                    self._commfold_noted = True
                    local = getattr(self, "use_local_argmax_reduction", False)
                    log.info("commfold: %s", v1_pick_note(self, local))
                return model
            return _get_model

        hook_points.wrap(base, "_greedy_sample", greedy, PICK)
        for cls in loaders:
            hook_points.wrap(cls, "_get_model", noted, PICK)
    if top_tokens:
        def supplied(original):
            def _get_model(self):
                model = original(self)
                if getattr(self, "use_local_argmax_reduction", False):
                    install_get_top_tokens(model, chosen)
                return model
            return _get_model

        for cls in loaders:
            hook_points.wrap(cls, "_get_model", supplied, TOP_TOKENS)


_UNSET = object()
