"""commfold in vLLM's speculative-decoding drafter (installed by the vLLM plugin in
every vLLM process when COMMFOLD_VLLM=1).

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

Both hooks patch the proposers of the runner vLLM will build and log one line each at
install, on or off and why (commfold.vllm.compat.runtime); each checks the lines of vLLM's
code it relies on.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os

from commfold.vllm.compat import hook_points, pins, releases, runtime
from commfold.config import Config
from commfold.vllm.spec_decode.speculators import V1_PROPOSERS, pick_note

log = logging.getLogger("commfold")

PICK_PASSES = ("replicate_vocab_parallel", "local_argmax")
PICK, TOP_TOKENS = "draft pick", "draft get_top_tokens"
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


_SPEC = "vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator"
# sample_draft's greedy pick by release -> whether NaN logits count as -inf: 0.32 and
# 0.33 take argmax (NaN wins), 0.34 greedy_argmax (NaN as -inf, ties to the first)
V2_PICK_LINES = {"sampled = logits.argmax(dim=-1)": False,
                 "sampled = greedy_argmax(logits)": True}
HOOK_POINTS_V2 = {
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


def states(config: Config, environ=os.environ, runner=None) -> list:
    """The two hooks' states (runtime.HookState), installing nothing."""
    off = None if pick_config(config) else \
        f"COMMFOLD_PASSES has none of {', '.join(PICK_PASSES)}"
    runner = runner or runtime.runner_choice(environ)
    version = 2 if runner.version == 2 else 1
    points_of = HOOK_POINTS_V2 if version == 2 else HOOK_POINTS
    pinned = {PICK: sample_draft_unpinned} if version == 2 else {}
    return [runtime.gate(hook, off=off, environ=environ, runner=runner, version=version,
                         missing=lambda points=points, hook=hook: hook_points.missing(points)
                         + pinned.get(hook, list)())
            for hook, points in points_of.items()]


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


def state(hook: str, config: Config, environ=os.environ, runner=None):
    """One of the two hooks' state (PICK, TOP_TOKENS), installing nothing."""
    return dict(zip((PICK, TOP_TOKENS), states(config, environ, runner)))[hook]


def install(hook: str, config: Config, environ=os.environ, runner=None) -> bool:
    """One of the two hooks (PICK: the greedy draft pick; TOP_TOKENS: a get_top_tokens
    for drafters without one under use_local_argmax_reduction) on the proposers of the
    runner vLLM will build, logging its line; True when on. Idempotent."""
    runner = runner or runtime.runner_choice(environ)
    if not state(hook, config, environ, runner).log().on:
        return False
    hook_v = _hook_v2_speculator if runner.version == 2 else _hook_v1_proposers
    hook_v(pick_config(config), hook == PICK, hook == TOP_TOKENS)
    return True


def uninstall(hook: str) -> None:
    """Undo install(hook) (tests: vLLM's own methods back)."""
    hook_points.unwrap_hook(hook)


def _hook_v1_proposers(chosen: Config | None, pick: bool, top_tokens: bool) -> None:
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
                if pick is not None and _slower(self, hidden_states):
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


def _slower(proposer, hidden) -> bool:
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
    if _slower(spec, hidden):
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


def _hook_v2_speculator(chosen: Config | None, pick: bool, top_tokens: bool) -> None:
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
