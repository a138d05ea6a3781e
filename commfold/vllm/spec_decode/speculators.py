"""Model Runner V2's speculator classes (vLLM 0.32 to 0.34) and how each picks its
greedy draft tokens with commfold on: the one table the draft hook's load-time line,
docs/vllm.md and the tests read.

Speculators whose drafting calls ``DraftModelSpeculator.sample_draft`` get commfold's
pick there (commfold.vllm.spec_decode.draft: per call it still says when vLLM's runs, e.g.
probabilistic drafting); DSpark's greedy block gets it in ``_sample_sequential``
(commfold.vllm.spec_decode.dspark_pick). The others draft their own way; each is listed with what it
does, so the hook can say so in one line naming the class, and a class of a later
release (or a plugin's) that is not listed is named as unknown.
"""
from __future__ import annotations

SAMPLE_DRAFT = "sample_draft"  # commfold's pick in sample_draft (greedy drafting)
# commfold's pick in DSpark's _sample_sequential (commfold.vllm.spec_decode.dspark_pick)
DSPARK_BLOCK = "dspark_block"

# class name -> SAMPLE_DRAFT, or why the draft tokens are not commfold's pick
SPECULATORS = {
    "StandaloneARSpeculator": SAMPLE_DRAFT,  # draft_model
    "EagleSpeculator": SAMPLE_DRAFT,  # EAGLE, EAGLE-3 (d2t remap: RemappedPick)
    "MTPSpeculator": SAMPLE_DRAFT,
    "MultiModuleMTPSpeculator": SAMPLE_DRAFT,  # each step with its module's head
    "Gemma4Speculator": SAMPLE_DRAFT,  # soft-capped logits: vLLM's (top_tokens.soft_capped)
    "DFlashSpeculator": SAMPLE_DRAFT,
    "DSparkSpeculator": DSPARK_BLOCK,
    "XPressSpeculator": (
        "its Jacobi refinement reads the full base draft logits in its own kernels"),
    "DFlash2Speculator": (
        "its candidates come from vLLM's own vocab-parallel top-k "
        "(LogitsProcessor.get_top_k_tokens): no full-vocab gather to remove"),
    "LiLiCorrSpeculator": (
        "its candidates come from vLLM's own vocab-parallel top-k "
        "(LogitsProcessor.get_top_k_tokens): no full-vocab gather to remove"),
    "ExtractHiddenStatesSpeculator": "it drafts no tokens (it extracts hidden states)",
    "NgramGPUSpeculator": "it drafts from n-gram matches, without a draft model",
    "SuffixSpeculator": "it drafts from a suffix index, without a draft model",
}


# V1's proposers (0.32, 0.33): commfold's pick is in SpecDecodeBaseProposer._greedy_sample
V1_PROPOSERS = {
    "EagleProposer": SAMPLE_DRAFT,  # EAGLE, EAGLE-3, MTP
    "DraftModelProposer": SAMPLE_DRAFT,
    "DFlashProposer": SAMPLE_DRAFT,
    "Gemma4Proposer": (
        "it replays its own centroid pick (a masked embedding, no full-vocab gather) "
        "where it captured one, else commfold's"),
    "Step3p5MTPProposer": (
        "it picks per MTP step in its own method (_sample_draft_tokens_for_step)"),
}


def pick_note(cls, table: dict | None = None) -> tuple[bool, str]:
    """(commfold picks in sample_draft / _greedy_sample, the line's text) for a
    speculator (or, with V1_PROPOSERS, a V1 proposer) class."""
    how = (SPECULATORS if table is None else table).get(cls.__name__)
    if how == SAMPLE_DRAFT:
        return True, f"{cls.__name__}'s greedy draft tokens are commfold's pick"
    if how == DSPARK_BLOCK:
        return False, (f"{cls.__name__}'s greedy draft blocks are commfold's pick from "
                       "each rank's shard of the base logits plus the replicated Markov "
                       "bias (one exchange per position; each block vLLM's keeps says why)")
    if how is None:
        return False, (f"{cls.__name__} is not a speculator commfold knows: its draft "
                       "tokens are commfold's pick only where it calls sample_draft "
                       "(each such call says which)")
    return False, f"{cls.__name__}'s draft tokens are vLLM's: {how}"
