"""Which draft pick a drafter runs, for both runners' draft hooks (V1's proposers:
commfold.vllm.spec_decode.draft_v1; Model Runner V2's speculators: draft_v2): the passes
a draft pick may use (COMMFOLD_PASSES: replicate_vocab_parallel, local_argmax; neither:
vLLM's pick), commfold's pick for a proposer, and the cost table's veto per call."""
from __future__ import annotations

import logging

from commfold.config import Config

log = logging.getLogger("commfold")

PICK_PASSES = ("replicate_vocab_parallel", "local_argmax")
PICK, TOP_TOKENS = "draft pick", "draft get_top_tokens"


def pick_config(config: Config) -> Config | None:
    """`config` restricted to the passes a draft pick can use (None: none of them)."""
    passes = tuple(p for p in config.passes if p in PICK_PASSES)
    return config.replace(passes=passes) if passes else None


def choose_pick(proposer, config: Config | None, build=None):
    """commfold's draft pick for `proposer` (a vLLM SpecDecodeBaseProposer or V2
    speculator), or None where vLLM's own pick runs (see the module docstring).
    `build(model, config)` makes it (draft_top_tokens by default)."""
    from commfold.vllm.spec_decode.top_tokens import draft_top_tokens

    model = getattr(proposer, "model", None)
    if (config is None or getattr(proposer, "use_heterogeneous_vocab", False)
            or getattr(proposer, "use_local_argmax_reduction", False)
            or not callable(getattr(model, "compute_logits", None))):
        return None
    log.info("commfold: draft tokens of %s (%s) picked without a full-vocab gather (%s)",
             type(model).__name__, type(proposer).__name__, "+".join(config.passes))
    return (build or draft_top_tokens)(model, config)


def slower(proposer, hidden) -> bool:
    """The cost table leaves this call's pick to vLLM (commfold.vllm.target.pick_cost: its rows
    and the drafter's vocab and TP communicator, the same on every rank); noted in the
    step log as ``draft_pick``."""
    from commfold.vllm.target import pick_cost
    from commfold.vllm.observe import step_log

    model = getattr(proposer, "model", None)
    why = pick_cost.slower_for_model("draft", hidden, model) if model is not None else None
    if why:
        step_log.note("draft_pick", f"vLLM ({why})")
    return bool(why)
