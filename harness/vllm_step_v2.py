"""One Model Runner V2 sampling step both ways, in a vLLM TP group of rank-pool
processes spawned for V2 (tests of commfold.vllm.target.target_pick_v2): vLLM's real
ParallelLMHead + LogitsProcessor (harness.vllm_step.TinyLM), V2's real Sampler,
RejectionSampler, RequestState and InputBatch, and V2's own
``GPUModelRunner.sample`` run on a stand-in runner holding what it reads - once as
vLLM ships it, once under the installed vLLM's hook set: up to vLLM 0.33 its
``sample`` wrapped, from 0.34 its real ``DefaultModelState`` with commfold on the
extension points, called as the runner calls them (``custom_sampler`` once,
``preprocess_state`` before the step, then ``sample``).

Nothing here imports vLLM at module level: ``step_cases`` installs the Triton CPU
stand-in (harness.triton_cpu) first, so V2's Triton kernels run in the interpreter.
"""
from __future__ import annotations

import contextlib

from types import SimpleNamespace

import numpy as np
import torch

from harness.vllm_tp import default_config

MAX_REQS = 16
START = 40  # the position of each request's first scheduled token (past its prefill)


def sampler_for(vocab: int, params: list, steps: int, logprobs_mode: str = "raw_logprobs",
                histories: list | None = None, reasoning: dict | None = None):
    """V2's Sampler (+ RejectionSampler when steps > 0) with `params` (SamplingParams)
    added as requests 0..n-1, as the runner adds them. histories: per request
    (prompt_len, START token ids) - the prompt then its output so far (penalties
    read both); by default a prompt of tokens 0..START-1. reasoning: the reasoning
    markers V2's thinking budget reads ({"start", "natural_end", "end"}: token id
    lists, as vLLM's ReasoningConfig gives them)."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu.states import RequestState

    cpu = torch.device("cpu")
    states = RequestState(MAX_REQS, 256, 256, max(steps, 1), vocab, cpu)
    # request i in slot i, where the batch's idx_mapping (arange) and the Sampler's
    # add_request(i, ...) put it (RequestState pops its free slots from the end)
    states.free_indices = list(range(MAX_REQS))[::-1]
    for i in range(len(params)):
        prompt_len, ids = histories[i] if histories else (START, list(range(START)))
        states.add_request(f"r{i}", prompt_len, ids, 0, 16)
    states.apply_staged_writes()
    sampler = Sampler(default_config(), MAX_REQS, vocab, cpu, states,
                      logprobs_mode=logprobs_mode, num_speculative_tokens=steps + 1)
    if reasoning is not None:  # as the Sampler builds it from a reasoning model's config
        from vllm.v1.worker.gpu.sample.thinking_budget import ThinkingBudgetState

        sampler.thinking_budget_state = ThinkingBudgetState(states, SimpleNamespace(
            reasoning_start_token_ids=reasoning["start"],
            natural_reasoning_end_token_ids=reasoning["natural_end"],
            reasoning_end_token_ids=reasoning["end"]))
    for i, p in enumerate(params):
        sampler.add_request(i, p)
    sampler.apply_staged_writes()
    spec = SimpleNamespace(num_speculative_tokens=steps, enable_adaptive_verification=False,
                           rejection_sample_method="standard", synthetic_acceptance_rates=None,
                           fly_window_size=None, fly_entropy_threshold=None,
                           fly_entropy_top_k=None)
    rejection = RejectionSampler(sampler, spec, cpu) if steps else None
    return sampler, rejection, spec


def input_batch(drafts: list[list[int]], placeholder: int | None = None):
    """V2's InputBatch for one decode step: request r schedules its last token and
    its drafts (all rows are logits rows). placeholder: a request whose drafts V2
    reads as placeholders (its step starts inside its prefill)."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    n = [len(d) + 1 for d in drafts]
    reqs, tokens = len(drafts), sum(n)
    cu = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    req = np.repeat(np.arange(reqs), n)
    local = np.arange(tokens) - cu[:-1][req]
    ids = np.concatenate([[7] + d for d in drafts]).astype(np.int32)
    pos = START + local
    if placeholder is not None:
        pos[req == placeholder] -= START  # before its prefill ends
    i64 = dict(dtype=torch.int64)
    seq_lens = torch.tensor([START + k for k in n], dtype=torch.int32)
    return InputBatch(
        req_ids=[f"r{i}" for i in range(reqs)], num_reqs=reqs, num_reqs_after_padding=reqs,
        idx_mapping=torch.arange(reqs, **i64), idx_mapping_np=np.arange(reqs),
        expanded_idx_mapping=torch.tensor(req, **i64),
        expanded_local_pos=torch.tensor(local, dtype=torch.int32),
        num_scheduled_tokens=np.array(n, dtype=np.int32), num_tokens=tokens,
        num_tokens_after_padding=tokens, num_draft_tokens=tokens - reqs,
        num_draft_tokens_per_req=np.array(n, dtype=np.int32) - 1,
        query_start_loc=torch.tensor(cu), query_start_loc_np=cu, seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens.clone(), dcp_local_seq_lens=None,
        num_computed_tokens_np=np.full(reqs, START, dtype=np.int32),
        prefill_len_np=np.full(reqs, START, dtype=np.int32),
        num_computed_prefill_tokens_np=np.full(reqs, START, dtype=np.int32),
        is_prefilling_np=np.zeros(reqs, dtype=bool), has_prefill=False,
        decode_graph_eligible=True, input_ids=torch.tensor(ids),
        positions=torch.tensor(pos, **i64), is_padding=torch.zeros(tokens, dtype=torch.bool),
        logits_indices=torch.arange(tokens, **i64), cu_num_logits=torch.tensor(cu),
        cu_num_logits_np=cu, has_structured_output_reqs=False, prompt_lens=None)


def runner(model, vocab: int, params: list, steps: int, logprobs_mode: str = "raw_logprobs",
           model_state: bool = False, histories: list | None = None,
           reasoning: dict | None = None):
    """What V2's GPUModelRunner.sample (and commfold's hook) read of the runner;
    model_state: with V2's DefaultModelState for the model (vLLM 0.34's sample reads
    its compute_sample_logits)."""
    sampler, rejection, spec = sampler_for(vocab, params, steps, logprobs_mode, histories,
                                           reasoning)
    spec = spec if steps else None
    return SimpleNamespace(
        model=model, sampler=sampler, rejection_sampler=rejection, batch_sharder=None,
        speculator=SimpleNamespace(draft_logits=None), speculative_config=spec,
        structured_outputs_worker=grammar_worker(vocab, steps + 1), vocab_size=vocab,
        lora_config=None,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        model_state=default_state(model, spec) if model_state else None)


def new_draft_logits(steps: int, vocab: int, dtype: torch.dtype):
    """V2's draft logits cache, filled with 0.0 as V2 fills it: (what the speculator
    holds, its [MAX_REQS, steps, vocab] tensor) - up to vLLM 0.33 the tensor itself,
    from 0.34 a replicated DraftLogitsCache (as without batch-sharded sampling)."""
    try:
        from vllm.v1.worker.gpu.spec_decode.draft_logits import DraftLogitsCache
    except ImportError:  # up to 0.33
        cache = torch.zeros(MAX_REQS, steps, vocab, dtype=dtype)
        return cache, cache
    holder = DraftLogitsCache(MAX_REQS, steps, vocab, dtype=dtype, fill=0.0, device="cpu")
    return holder, holder.values


def model_state_hooks() -> bool:
    """Whether this vLLM's target pick acts through the model state (from 0.34)."""
    from commfold.vllm.target import target_pick_v2

    return target_pick_v2.hook_set() is not target_pick_v2.HOOK_SETS[0]


def grammar_worker(vocab: int, query_len: int):
    """V2's StructuredOutputsWorker, built as the runner builds it (up to vLLM 0.33
    it also takes the bonus tokens per step: one). Its module's PIN_MEMORY is set
    False, as vLLM's CPU platform has it: the release tier's vLLM (a CUDA wheel)
    resolves no platform in these ranks and would pin the bitmask's row mapping."""
    import inspect

    from vllm.v1.worker.gpu import structured_outputs
    from vllm.v1.worker.gpu.structured_outputs import StructuredOutputsWorker

    structured_outputs.PIN_MEMORY = False

    kw = dict(max_num_logits=MAX_REQS * query_len, vocab_size=vocab,
              device=torch.device("cpu"), mask_stride=query_len)
    if "num_bonus_tokens" in inspect.signature(StructuredOutputsWorker).parameters:
        kw["num_bonus_tokens"] = 1
    return StructuredOutputsWorker(**kw)


def grammar_output(case: dict, batch, worker):
    """V2's GrammarOutput for case["grammar"] (None without): {"reqs": the requests
    with a grammar, "rows": kinds of bitmask rows, cycled over the rows V2's `worker`
    maps (up to vLLM 0.33: a request's drafts + 1; from 0.34: its mask stride) -
    "random" (bits at random, the case's seed, "density" of them set), "none" (every
    token masked), "low" (only tokens below vocab / 3: one shard), "few" (three
    tokens across the vocab), "all"}, "acceptable" (per request, the drafts its rows
    constrain; up to vLLM 0.33, whose GrammarOutput says so); the bits past the vocab
    in the last word at random too (V2 never reads them)."""
    import itertools

    from vllm.v1.core.sched.output import GrammarOutput

    spec = case.get("grammar")
    if spec is None:
        return None
    vocab = case["vocab"]
    if hasattr(worker, "num_bonus_tokens"):
        count = sum(int(batch.num_draft_tokens_per_req[r]) + 1 for r in spec["reqs"])
    else:
        count = len(spec["reqs"]) * worker.mask_stride
    words = -(-vocab // 32)
    g = torch.Generator().manual_seed(case["seed"] + 5)
    rows = []
    for kind in itertools.islice(itertools.cycle(spec["rows"]), count):
        bits = torch.rand(words * 32, generator=g) < spec.get("density", 0.5)
        allow = torch.arange(words * 32)
        inside = {"random": bits, "none": torch.zeros_like(bits),
                  "low": bits & (allow < vocab // 3), "all": torch.ones_like(bits),
                  "few": torch.isin(allow, torch.tensor([5, vocab // 2 + 1, vocab - 1]))}[kind]
        bits = torch.where(allow < vocab, inside, bits)
        packed = (bits.view(words, 32).long() << torch.arange(32)).sum(-1)
        rows.append(torch.where(packed >= 2**31, packed - 2**32, packed).int())
    out = GrammarOutput([f"r{i}" for i in spec["reqs"]], torch.stack(rows).numpy())
    if "acceptable" in spec and hasattr(out, "num_acceptable_drafts"):  # up to 0.33
        out.num_acceptable_drafts = spec["acceptable"]
    return out


def default_state(model, spec):
    """V2's DefaultModelState for `model` holding what its sampling methods and
    commfold's hook read (the runner builds it from the engine's config: its __init__
    needs a model config these tests have no use for)."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    state = DefaultModelState.__new__(DefaultModelState)
    config = default_config()
    state.model, state.device = model, torch.device("cpu")
    state.vllm_config = SimpleNamespace(
        speculative_config=spec, lora_config=None, watermark_config=None,
        parallel_config=config.parallel_config)
    return state


def hooked_sample(original, r, hidden, batch, case: dict | None = None, grammar=None):
    """V2's sample on runner `r` under the installed vLLM's hook set (its output).
    grammar: V2's GrammarOutput of the step (grammar_output), None without.
    case (model state set only): "structured" - the batch holds a structured-output
    request (set with a grammar too, unless "unmarked"); "rebatch" - sample() gets
    another batch object than the one decided on
    (as a context-parallel batch restored for sampling)."""
    import dataclasses

    from commfold.vllm.target import target_pick_state, target_pick_v2

    if not model_state_hooks():
        return target_pick_v2._sample(original)(r, hidden, batch, grammar)[0]
    case = case or {}
    if case.get("structured") or (grammar is not None and not case.get("unmarked")):
        batch = dataclasses.replace(batch, has_structured_output_reqs=True)
    target_pick_state.install()
    try:
        state = r.model_state
        r.sampler, r.rejection_sampler = state.custom_sampler(r.sampler)  # at load
        decided = dataclasses.replace(batch) if case.get("rebatch") else batch
        state.preprocess_state(decided, None, None, None)  # in execute_model
        return original(r, hidden, batch, grammar)[0]
    finally:
        target_pick_state.uninstall()


def left_alone(world: int) -> list[dict]:
    """In a spawned rank (vLLM 0.34 on): model states commfold must leave alone - a
    class overriding compute_sample_logits, one overriding custom_sampler, a model
    with its own get_model_state_cls, batch-sharded sampling, watermarking - and the
    default state: the line each gets at __init__ and what custom_sampler returns."""
    import logging

    from harness import triton_cpu

    triton_cpu.install()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (what vLLM's CPU worker imports first)
    from vllm.v1.worker.gpu.model_states.interface import ModelState

    from commfold.vllm.target import target_pick_state
    from harness import vllm_step
    from harness.vllm_tp import init_vllm_tp

    init_vllm_tp(world, shm=False, reuse=True)

    class State(ModelState):  # the abstract per-step methods, unused here
        def prepare_inputs_embeds(self, *a):
            return None

        def prepare_inputs(self, *a):
            return {}

        def prepare_dummy_inputs(self, *a):
            return {}

        def prepare_attn(self, *a, **kw):
            return {}

    class OwnLogits(State):
        def compute_sample_logits(self, hidden_states):
            return self.model.compute_logits(hidden_states)

    class OwnSampler(State):
        def custom_sampler(self, sampler):
            return None

    class OwnState(vllm_step.TinyLM):
        @staticmethod
        def get_model_state_cls():
            return State

    def config(sharded: bool = False):
        return SimpleNamespace(
            model_config=SimpleNamespace(get_inputs_embeds_size=lambda: vllm_step.H,
                                         dtype=torch.float32),
            scheduler_config=SimpleNamespace(max_num_seqs=MAX_REQS,
                                             max_num_batched_tokens=256),
            parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                            enable_batch_sharded_sampling=sharded),
            speculative_config=None, lora_config=None, watermark_config=None)

    marked = config()
    marked.watermark_config = SimpleNamespace()
    variants = [("default", State, vllm_step.TinyLM, config()),
                ("compute_sample_logits", OwnLogits, vllm_step.TinyLM, config()),
                ("custom_sampler", OwnSampler, vllm_step.TinyLM, config()),
                ("get_model_state_cls", State, OwnState, config()),
                ("batch-sharded", State, vllm_step.TinyLM, config(sharded=True)),
                ("watermarking", State, vllm_step.TinyLM, marked)]
    sampler = sampler_for(1500, [], 0)[0]
    out = []
    target_pick_state.install()
    try:
        for name, cls, lm, cfg in variants:
            model = lm(1500, torch.float32, 1, False)
            records: list[str] = []
            handler = logging.Handler()
            handler.emit = lambda record, records=records: records.append(record.getMessage())
            logger = logging.getLogger("commfold")
            logger.addHandler(handler)
            old_level = logger.level
            logger.setLevel(logging.INFO)  # setLevel: clears the loggers' level cache
            try:
                state = cls(cfg, model, None, torch.device("cpu"))
                custom = state.custom_sampler(sampler)
            finally:
                logger.removeHandler(handler)
                logger.setLevel(old_level)
            out.append(dict(variant=name, state=cls.__name__, model=type(model).__name__,
                            lines=records, custom=None if custom is None else [
                                type(x).__name__ for x in custom]))
    finally:
        target_pick_state.uninstall()
    return out


def valid(out) -> list[list[int]]:
    """The sampled tokens V2's postprocessing reads: the first num_sampled per row."""
    return [row[:k] for row, k in zip(out.sampled_token_ids.tolist(), out.num_sampled.tolist())]


def step_cases(world: int, cases: list[dict]) -> list[dict]:
    """In a spawned rank: each case's step through V2's sample, as vLLM ships it and
    under commfold's hook; tokens, counts, the hook's decision, collectives."""
    from harness import triton_cpu

    triton_cpu.install()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (what vLLM's CPU worker imports first)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from commfold.vllm.observe import step_log as vllm_comm_log
    from commfold.distributed.comm_log import record_collectives
    from harness import vllm_step
    from harness.vllm_tp import init_vllm_tp

    tp = init_vllm_tp(world, shm=False, reuse=True)
    original = GPUModelRunner.__dict__["sample"]
    states = model_state_hooks()
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        # a NaN column, not a NaN row: Triton's interpreter fails on an all-NaN block
        lm = vllm_step.TinyLMGatherOnly if case.get("gather_only") else vllm_step.TinyLM
        model = lm(case["vocab"], dtype, case["seed"], case["ties"],
                   nan_column=case.get("nan_column"), tied=case.get("tied", False),
                   soft_cap=case.get("soft_cap"), neg_inf_rows=case.get("neg_inf_rows", ()))
        drafts = case.get("drafts") or [[] for _ in range(case["rows"])]
        params = [_params(p) for p in case["row_params"]] if "row_params" in case \
            else [_params(case.get("params", {}) or dict(temperature=0.0)) for _ in drafts]
        histories = _histories(case, len(drafts))
        steps = max(len(d) for d in drafts)
        batch = input_batch(drafts, case.get("placeholder"))
        if case.get("positions"):  # per request, added to its rows' positions
            batch.positions += torch.tensor(case["positions"])[batch.expanded_idx_mapping]
        h = vllm_step.hidden(batch.num_tokens, dtype, case["seed"] + 1, case["ties"],
                             case.get("special")) * case.get("scale", 1.0)
        if case.get("accept"):  # drafts from the target's argmax (some accepted)
            full = model.compute_logits(h).float().argmax(-1)
            ids = batch.input_ids
            for r, d in enumerate(drafts):
                lo = int(batch.cu_num_logits_np[r])
                for i in range(len(d)):
                    ids[lo + 1 + i] = int(full[lo + i]) if (r + i) % 3 != 2 else 0
        mode = case.get("logprobs_mode", "raw_logprobs")
        # V2 draws an unseeded request's seed from numpy: the same for both runners
        np.random.seed(case["seed"])
        theirs_runner = runner(model, case["vocab"], params, steps, mode, states, histories,
                               case.get("reasoning"))
        np.random.seed(case["seed"])
        ours_runner = runner(model, case["vocab"], params, steps, mode, states, histories,
                             case.get("reasoning"))
        grammar = grammar_output(case, batch, theirs_runner.structured_outputs_worker)
        cuts: dict = {"v2": [], "ours": []}  # V2's top-k / top-p cut, rows made whole
        with record_collectives() as vllm_log, v2_cut(cuts["v2"]):
            theirs = original(theirs_runner, h, batch, grammar)[0]
        notes: list[str] = []
        note = vllm_comm_log.note
        vllm_comm_log.note = lambda key, value, notes=notes: notes.append(value)
        try:
            with record_collectives() as ours_log, padded_kernel(case.get("padded")), \
                    whole_cut(cuts["ours"]):
                ours = hooked_sample(original, ours_runner, h, batch, case, grammar)
        finally:
            vllm_comm_log.note = note
        shard = model.head[0].weight.shape[0]
        out.append(dict(
            case=case, rank=tp.rank_in_group, notes=notes,
            ours=valid(ours), theirs=valid(theirs),
            counts=(ours.num_sampled.tolist(), ours.num_rejected.tolist()),
            vllm_counts=(theirs.num_sampled.tolist(), theirs.num_rejected.tolist()),
            dtype=(ours.sampled_token_ids.dtype, theirs.sampled_token_ids.dtype),
            ours_gathers=_vocab_gathers(ours_log, shard), calls=ours_log.calls(),
            wide=wide_gathers(ours_log, shard), shard=shard, same_cut=same_rows(cuts),
            vllm_gathers=_vocab_gathers(vllm_log, shard),
            logprobs=_logprobs(ours), vllm_logprobs=_logprobs(theirs),
            ranks=_ranks(model.compute_logits(h[batch.logits_indices]), ours),
            score_diff=_score_diff(ours, theirs)))
    return out


@contextlib.contextmanager
def v2_cut(into: list):
    """V2's Sampler's top-k / top-p cut (the rows apply_top_k_top_p returns), kept."""
    from vllm.v1.worker.gpu.sample import sampler

    original = sampler.apply_top_k_top_p

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        into.append(out.clone())
        return out

    sampler.apply_top_k_top_p = spy
    try:
        yield
    finally:
        sampler.apply_top_k_top_p = original


@contextlib.contextmanager
def whole_cut(into: list):
    """(rows, cut rows) of each commfold.vllm.sample.shard_edge_rows.cut call, kept."""
    from commfold.vllm.sample import shard_edge_rows

    original = shard_edge_rows.cut

    def spy(rows, which, *args, **kwargs):
        out = original(rows, which, *args, **kwargs)
        into.append((which.clone(), out.clone()))
        return out

    shard_edge_rows.cut = spy
    try:
        yield
    finally:
        shard_edge_rows.cut = original


def same_rows(cuts: dict) -> bool | None:
    """Whether the rows commfold made whole and cut are V2's cut rows bit for bit
    (None: none made whole)."""
    if not cuts["ours"]:
        return None
    ((which, rows),), (v2,) = cuts["ours"], cuts["v2"]
    return bool(torch.equal(rows, v2[which]))


@contextlib.contextmanager
def padded_kernel(on: bool | None):
    """With `on`: rows made whole for vLLM's top-k / top-p kernel are run with no-op
    rows besides, to over its split batch size, as on CUDA (shard_edge_rows)."""
    from commfold.vllm.sample import shard_edge_rows

    rows = shard_edge_rows.kernel_rows
    if on:
        from vllm.v1.sample.ops import topk_topp_triton

        split = topk_topp_triton._SPLIT_MAX_BATCH
        shard_edge_rows.kernel_rows = lambda d, batch, device: max(d, split + 1)
    try:
        yield
    finally:
        shard_edge_rows.kernel_rows = rows


def _params(p: dict):
    """SamplingParams(**p), a "structured_outputs" dict as vLLM's params object."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    if isinstance(p.get("structured_outputs"), dict):
        p = dict(p, structured_outputs=StructuredOutputsParams(**p["structured_outputs"]))
    return SamplingParams(**p)


def _histories(case: dict, reqs: int) -> list | None:
    """case["history"] = n: each request's START tokens drawn over the whole vocab (from
    the case's seed), the last n of them its output so far, request r's last ones
    case["tails"][r] where given; None: the default."""
    n = case.get("history")
    if n is None:
        return None
    g = torch.Generator().manual_seed(case["seed"] + 3)
    out = [(START - n, torch.randint(0, case["vocab"], (START,), generator=g).tolist())
           for _ in range(reqs)]
    for (_, ids), tail in zip(out, case.get("tails", ())):
        ids[len(ids) - len(tail):] = tail
    return out


def _logprobs(out):
    """(token ids, ranks) of a SamplerOutput's logprobs, None without."""
    t = out.logprobs_tensors
    if t is None:
        return None
    return t.logprob_token_ids.tolist(), t.selected_token_ranks.tolist(), str(t.logprobs.dtype)


def same_step(r: dict) -> str:
    """Assert what every step_cases result must hold - the same sampled tokens, counts
    and token dtype as V2's, and V2's one logits gather in its own run; returns the
    result's label for further asserts."""
    where = f"rank {r['rank']} {r['case']}"
    assert r["ours"] == r["theirs"], where
    assert r["counts"] == r["vllm_counts"], where
    assert r["dtype"][0] == r["dtype"][1], where
    assert r["vllm_gathers"] == 1, where
    return where


def steps_as_v2s(results: list[list[dict]]):
    """Every rank's step_cases results, each asserted first to be V2's step
    (``same_step``): yields (result, its case, its label)."""
    for res in results:
        for r in res:
            yield r, r["case"], same_step(r)


def score_ulps(case: dict) -> int:
    """How many float32 ulps ours may differ from V2's logprob scores (``score_diff``):
    none in the logits modes (the logits are exact), 4 in the logprobs modes (V2's own
    float32 sum order)."""
    return 0 if "logits" in case.get("logprobs_mode", "") else 4


def logprobs_agree(r: dict) -> bool:
    """Ours and V2's logprobs: the same ids and dtype; the ranks V2 computes on a GPU.
    V2's rank kernel under Triton's interpreter counts bf16 logits wrongly (its masked
    lanes' -inf compares as >= the token's), so bf16 ranks are checked against torch,
    float32 ones against V2 too."""
    ours, theirs = r["logprobs"], r["vllm_logprobs"]
    if ours is None or theirs is None:
        return ours is theirs
    same = ours[0] == theirs[0] and ours[2] == theirs[2] and ours[1] == r["ranks"]
    return same and (r["case"]["dtype"] != "float32" or ours[1] == theirs[1])


def _ranks(logits, out):
    """What V2's rank kernel computes on a GPU - how many logits are >= the token's -
    for the tokens `out` sampled, in torch (None without logprobs)."""
    if out.logprobs_tensors is None:
        return None
    tokens = out.sampled_token_ids[:, :1]
    return (logits >= logits.gather(1, tokens)).sum(-1).tolist()


def _score_diff(ours, theirs):
    """Largest |difference| of the two outputs' scores (equal where both are -inf or
    NaN), in float32 ulps of the row's log-sum-exp L (column 0 scores the greedy token,
    the maximum: logprob -L; logits modes: of the logit), where the float32 sums'
    rounding lands; None when either has no logprobs."""
    if ours.logprobs_tensors is None or theirs.logprobs_tensors is None:
        return None
    a, b = ours.logprobs_tensors.logprobs, theirs.logprobs_tensors.logprobs
    if a.shape != b.shape:
        return float("inf")
    same = (a == b) | (a.isnan() & b.isnan())
    big = torch.maximum(b[:, :1].abs(), torch.ones_like(b[:, :1])).expand_as(b)
    ulp = torch.nextafter(big, torch.full_like(big, float("inf"))) - big
    return float(((a - b).abs() / ulp).where(~same, torch.zeros_like(a)).max())


def _vocab_gathers(log, shard: int) -> int:
    return len(wide_gathers(log, shard))


def wide_gathers(log, shard: int) -> list[tuple[list, str, int]]:
    """(shape, dtype, bytes) of each gather a shard wide (vLLM's of the logits, or
    commfold's of rows made whole for vLLM's top-k / top-p kernel)."""
    return [([list(s) for s in e.shapes], e.dtype, e.bytes) for e in log.events
            if e.name in ("all_gather", "gather")
            and any(s and s[-1] >= shard for s in e.shapes)]


def prompt_cases(world: int, cases: list[dict]) -> list[dict]:
    """In a spawned rank: V2's compute_prompt_logprobs_with_chunking for each case's
    prompt positions, as vLLM ships it and under commfold's hook (the head found from a
    V2 runner's sample(), as in an engine step); ids, ranks, score differences, the
    hook's note, collectives. case: vocab, dtype, seed, ties, rows, k, logprobs_mode,
    chunk (V2's CHUNK_SIZE for the case), targets_outside (a target past the vocab)."""
    from harness import triton_cpu

    triton_cpu.install()
    import vllm.v1.worker.cpu.shm  # noqa: F401
    from vllm.v1.worker.gpu.sample import prompt_logprob

    from commfold.distributed.comm_log import record_collectives
    from commfold.vllm.observe import step_log
    from commfold.vllm.target import target_pick_v2, v2_pick
    from commfold.vllm.target.logits_head import LogitsHead
    from harness import vllm_step
    from harness.vllm_tp import init_vllm_tp

    tp = init_vllm_tp(world, shm=False, reuse=True)
    original = prompt_logprob.compute_prompt_logprobs_with_chunking
    original = getattr(original, "__wrapped__", original)
    chosen = target_pick_v2.hook_set()
    hooked = target_pick_v2._prompt_scores(original, chosen.prompt_ids)
    chunk_size = prompt_logprob.CHUNK_SIZE
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        model = vllm_step.TinyLM(case["vocab"], dtype, case["seed"], case["ties"])
        h = vllm_step.hidden(case["rows"], dtype, case["seed"] + 1, case["ties"])
        g = torch.Generator().manual_seed(case["seed"] + 2)
        targets = torch.randint(0, case["vocab"], (case["rows"],), generator=g)
        if case.get("targets_outside"):
            targets[-1] = case["vocab"] + 3
        if chosen is target_pick_v2.HOOK_SETS[0]:  # the head found at a sample() step
            head = target_pick_v2._head(runner(model, case["vocab"], [], 0))
        else:  # the head found at custom_sampler
            head = LogitsHead.of(model, lora=False, pipeline=False, logits_local=True)[0]
        v2_pick.note_head(model, head)
        prompt_logprob.CHUNK_SIZE = case.get("chunk", chunk_size)
        args = (targets, h, model.compute_logits, case["k"],
                case.get("logprobs_mode", "raw_logprobs"))
        notes: list[str] = []
        note = step_log.note
        step_log.note = lambda key, value, notes=notes: notes.append(value)
        try:
            with record_collectives() as theirs_log:
                theirs = original(*args)
            with record_collectives() as ours_log:
                ours = hooked(*args)
        finally:
            step_log.note = note
            prompt_logprob.CHUNK_SIZE = chunk_size
            v2_pick.note_head(model, None)
        logits = model.compute_logits(h)
        inside = targets < case["vocab"]
        want_ranks = (logits >= logits.gather(1, targets.clamp(max=case["vocab"] - 1)[:, None])
                      ).sum(-1)
        shard = model.head[0].weight.shape[0]
        out.append(dict(
            case=case, rank=tp.rank_in_group, notes=notes,
            ids=ours[0].tolist() == theirs[0].tolist(),
            ids_dtype=(ours[0].dtype, theirs[0].dtype),
            ranks=bool((ours[2] == want_ranks)[inside].all()),
            vllm_ranks=ours[2].tolist() == theirs[2].tolist(),
            score_diff=_score_diff(*(SimpleNamespace(logprobs_tensors=SimpleNamespace(
                logprobs=x[1])) for x in (ours, theirs))),
            ours_gathers=_vocab_gathers(ours_log, shard), calls=ours_log.calls(),
            vllm_gathers=_vocab_gathers(theirs_log, shard)))
    return out
