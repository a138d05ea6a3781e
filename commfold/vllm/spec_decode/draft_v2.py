"""The greedy draft pick in Model Runner V2's speculators (installed by the vLLM
plugin with commfold.vllm.spec_decode.draft).

Model Runner V2 drafts with its own speculator
(``vllm.v1.worker.gpu.spec_decode.speculator.DraftModelSpeculator``): its greedy draft
pick is ``sample_draft``'s pick over ``compute_draft_logits(...)`` (draft_logits None:
no probabilistic drafting, which is commfold.vllm.spec_decode.draft_sampled's, a wrapper over
this one), replaced by the same ``draft_top_tokens`` where no
acceptance estimator reads the full logits and the speculator's compute_draft_logits
is one commfold knows (``LOGITS_ROUTES``: the base one, or multi-module MTP's, which
passes ``spec_step_idx`` so each step picks with its module's head). The pick's NaN
rule follows the release's line (``V2_PICK_LINES``: ``argmax`` on 0.32/0.33, NaN
wins; ``greedy_argmax`` on 0.34, NaN as -inf). A call that keeps vLLM's pick says
why once per class and reason, and every speculator's load says whose pick it runs
(commfold.vllm.spec_decode.speculators). Its ``use_local_argmax_reduction`` check gets a
``get_top_tokens(hidden_states, spec_step_idx=None)`` installed on a drafter without
one just before it runs.
"""
from __future__ import annotations

import functools
import inspect
import logging

from commfold.config import Config
from commfold.vllm.compat import hook_points, pins, releases
from commfold.vllm.spec_decode.draft_choice import PICK, TOP_TOKENS, choose_pick, slower
from commfold.vllm.spec_decode.speculators import pick_note

log = logging.getLogger("commfold")

_SPEC = "vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator"
# sample_draft's greedy pick by release -> whether NaN logits count as -inf: 0.32 and
# 0.33 take argmax (NaN wins), 0.34 greedy_argmax (NaN as -inf, ties to the first)
V2_PICK_LINES = {"sampled = logits.argmax(dim=-1)": False,
                 "sampled = greedy_argmax(logits)": True}
HOOK_POINTS = {
    PICK: ((f"{_SPEC}.sample_draft",
            "logits = self.compute_draft_logits(hidden_states, spec_step_idx)"),
           (f"{_SPEC}.sample_draft", tuple(V2_PICK_LINES)),
           (f"{_SPEC}.compute_draft_logits", "return self.model.compute_logits(hidden_states)")),
    TOP_TOKENS: ((f"{_SPEC}.load_model", "self._validate_local_argmax_reduction()"),
                 (f"{_SPEC}._validate_local_argmax_reduction",
                  'if not hasattr(self.model, "get_top_tokens"):'),
                 (f"{_SPEC}.get_draft_top_tokens",
                  "return self.model.get_top_tokens(hidden_states)")),
}


def v2_nan_as_neginf() -> bool:
    """Whether this vLLM's V2 draft pick counts NaN logits as -inf: sample_draft's
    line in the release it is read as (releases.here; the hook is off where
    sample_draft has neither line)."""
    return releases.here().at_least("0.34.0")


# V2's sample_draft as commfold checked it, its whole source pinned per release (pins.json).
# On a greedy call the pick returns commfold's tokens in place of the body's own pick, so
# a body commfold has not read turns the pick off with a line
SAMPLE_DRAFT = pins.pinned(f"{_SPEC}.sample_draft")


def sample_draft_unpinned() -> list[str]:
    """[] when this vLLM's sample_draft is one commfold checked, else why not."""
    where = f"{_SPEC}.sample_draft"
    try:
        source = inspect.getsource(inspect.unwrap(hook_points.resolve(where)))
    except Exception as e:  # moved, renamed, no source
        return [f"{where} ({type(e).__name__})"]
    here = releases.here().release
    if here is not None and SAMPLE_DRAFT.holds(source, here.version):
        return []
    return [f"{where}: its source (sha256 {hook_points.source_hash(source)}) is not one "
            f"commfold checked ({SAMPLE_DRAFT.releases()})"]


# how a speculator's compute_draft_logits computes its logits, by the class that
# defines it: the keyword arguments it passes model.compute_logits (from the draft step
# index), and the line of vLLM's it relies on (checked at first use)
_MMTP = "vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator:MultiModuleMTPSpeculator"
LOGITS_ROUTES = {
    _SPEC: ("return self.model.compute_logits(hidden_states)", False),
    _MMTP: ("return self.model.compute_logits(hidden_states, spec_step_idx=spec_step_idx)",
            True),
}


# the same as hook points (tools/vllm_compat.py lists them)
ROUTE_POINTS = tuple((f"{where}.compute_draft_logits", line)
                     for where, (line, _) in LOGITS_ROUTES.items())


@functools.cache
def logits_route(cls) -> bool | str:
    """Whether `cls`'s compute_draft_logits passes the draft step index to the
    drafter's compute_logits (a multi-module MTP speculator: each step's module has its
    own head), or why commfold cannot pick for it (a str)."""
    defined = cls.compute_draft_logits
    for where, (line, by_step) in LOGITS_ROUTES.items():
        try:
            known = hook_points.resolve(where).__dict__.get("compute_draft_logits")
        except (ImportError, AttributeError):
            continue
        if known is not None and inspect.unwrap(defined) is inspect.unwrap(known):
            gone = hook_points.missing(((f"{where}.compute_draft_logits", line),))
            return f"vLLM changed {gone[0]}" if gone else by_step
    owner = defined.__qualname__.rpartition(".")[0] or defined.__qualname__
    return f"its compute_draft_logits ({owner}'s) is not one commfold knows"


def why_vllm_pick(spec, draft_logits) -> str | None:
    """Why the speculator `spec`'s greedy draft pick stays vLLM's this call, or None."""
    if draft_logits is not None:
        return ("probabilistic drafting: vLLM's Gumbel sampler reads the full draft logits "
                "(commfold.vllm.spec_decode.draft_sampled draws from the shards where its hook "
                "is on)")
    if getattr(spec, "acceptance_estimator", None) is not None:
        return "adaptive verification's acceptance estimator reads the full draft logits"
    model = getattr(spec, "model", None)
    if not callable(getattr(model, "compute_logits", None)):
        return f"its drafter {type(model).__name__} has no compute_logits"
    route = logits_route(type(spec))
    return route if isinstance(route, str) else None


_logged: set = set()


def log_vllm_pick(spec, why: str) -> None:
    """One line per speculator class and reason, naming the class."""
    key = (type(spec).__name__, why)
    if key not in _logged:
        _logged.add(key)
        log.info("commfold: %s's draft tokens are vLLM's pick, with its full-vocab gather: %s",
                 key[0], why)


def _v2_tokens(spec, chosen: Config | None, hidden, draft_logits, spec_step_idx: int):
    """commfold's greedy draft tokens for this sample_draft call, or None where vLLM's
    pick runs (logged once per class and reason; use_local_argmax_reduction: vLLM's
    get_draft_top_tokens, a local pick already)."""
    if getattr(spec, "use_local_argmax_reduction", False):
        return None
    why = why_vllm_pick(spec, draft_logits)
    if why is not None:
        log_vllm_pick(spec, why)
        return None
    if slower(spec, hidden):
        return None
    picks = spec.__dict__.get("_commfold_pick")
    if picks is None:
        from commfold.vllm.spec_decode.top_tokens import StepPicks

        nan = v2_nan_as_neginf()
        picks = spec._commfold_pick = choose_pick(
            spec, chosen, lambda model, config: StepPicks(model, config, nan))
    if logits_route(type(spec)) is True:
        return picks(hidden, spec_step_idx=spec_step_idx)
    return picks(hidden)


def load_note(cls, local: bool, installed: bool) -> str:
    """The line a V2 speculator's load logs: whose pick its draft tokens are."""
    ours, note = pick_note(cls)
    if ours and local:
        whose = " (commfold's: it had none)" if installed else ""
        return (f"{cls.__name__} drafts with use_local_argmax_reduction: vLLM's "
                f"get_draft_top_tokens picks, with the drafter's get_top_tokens{whose}")
    route = logits_route(cls) if ours else None
    if isinstance(route, str):
        return f"{cls.__name__}'s draft tokens are vLLM's pick: {route}"
    return note


def hook(chosen: Config | None, pick: bool, top_tokens: bool) -> None:
    """Model Runner V2's DraftModelSpeculator: the greedy draft pick in sample_draft,
    and get_top_tokens installed before its use_local_argmax_reduction check."""
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator as spec

    from commfold.vllm.spec_decode.top_tokens import StepPicks, install_get_top_tokens

    if pick:
        def sampled(original):
            def sample_draft(self, hidden_states, *args, **kwargs):
                draft_logits = args[5] if len(args) > 5 else kwargs.get("draft_logits")
                step = args[6] if len(args) > 6 else kwargs.get("spec_step_idx", 0)
                tokens = _v2_tokens(self, chosen, hidden_states, draft_logits, step)
                if tokens is None:
                    return original(self, hidden_states, *args, **kwargs)
                return tokens
            return sample_draft

        def noted(original):  # under get_top_tokens' wrapper: says whether it supplied one
            def _validate_local_argmax_reduction(self):
                supplied = isinstance(getattr(self.model, "__dict__", {}).get("get_top_tokens"),
                                      StepPicks)
                log.info("commfold: %s", load_note(type(self), _v2_local(self), supplied))
                return original(self)
            return _validate_local_argmax_reduction

        hook_points.wrap(spec, "sample_draft", sampled, PICK)
        hook_points.wrap(spec, "_validate_local_argmax_reduction", noted, PICK)
        _hook_dspark(chosen)
    if top_tokens:
        def supplied(original):
            def _validate_local_argmax_reduction(self):
                if _v2_local(self):
                    install_get_top_tokens(self.model, chosen, v2_nan_as_neginf())
                return original(self)
            return _validate_local_argmax_reduction

        hook_points.wrap(spec, "_validate_local_argmax_reduction", supplied, TOP_TOKENS)


def _v2_local(spec) -> bool:
    """Whether a V2 speculator drafts greedily with use_local_argmax_reduction."""
    return getattr(spec, "use_local_argmax_reduction", False) and getattr(
        spec.speculative_config, "draft_sample_method", None) != "probabilistic"


def _hook_dspark(chosen: Config | None) -> None:
    """V2's DSpark speculator: a sharded Markov head replicated
    (commfold.vllm.spec_decode.eager_heads)."""
    try:
        from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
    except ImportError as e:  # a vLLM without DSpark: nothing to hook
        log.info("commfold: no DSpark speculator in this vLLM (%s)", e)
        return
    from .dspark_pick import hook as hook_block
    from .eager_heads import hook_markov_head

    hook_block(chosen, PICK)  # the greedy block's pick from the base logits' shards
    if chosen is None or "load_draft_model" not in vars(DSparkSpeculator):
        return

    def loaded(original):
        def load_draft_model(self, *args, **kwargs):
            model = original(self, *args, **kwargs)
            hook_markov_head(model, chosen)
            return model
        return load_draft_model

    hook_points.wrap(DSparkSpeculator, "load_draft_model", loaded, PICK)
