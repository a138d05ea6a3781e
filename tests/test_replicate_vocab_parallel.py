"""replicate_vocab_parallel on real gloo ranks: vocab-parallel embeddings (funcol and
vLLM spellings) and LM heads computed on a replicated full weight, against the sharded
original run eagerly. Embeddings must be bit-identical (ids at every shard boundary,
out-of-range ids, -0.0/inf/NaN rows); LM-head logits within f32 matmul rounding;
steady-state steps run no collective; a changed shard is picked up on the next call."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import commfold
from commfold.ops import replicate as rep_ops
from commfold.distributed.comm_log import record_collectives

from harness.gathers import all_gather_last_dim

H = 8
V = 23  # not divisible by 2 or 4: the last shard is shorter / padded
PASS = "replicate_vocab_parallel"
STRICT = commfold.Config(passes=(PASS,), strict=True)


# --------------------------------------------------------------- programs (per rank)

def _rank():
    return dist.get_rank(), dist.get_world_size()


def funcol_bounds(vocab, world, rank):
    """torch.chunk-like: ceil-sized shards, the last one shorter."""
    vs = -(-vocab // world)
    return min(rank * vs, vocab), min((rank + 1) * vs, vocab)


def make_funcol_embedding(start, end):
    def emb(ids, w):
        mask = (ids < start) | (ids >= end)
        x = (ids - start).masked_fill(mask, 0)
        e = F.embedding(x, w).masked_fill(mask.unsqueeze(-1), 0.0)
        return funcol.all_reduce(e, "sum", dist.group.WORLD)
    return emb


def vllm_indices(org, added, pad, world, rank):
    """vLLM's VocabParallelEmbedding shard indices (vocab_parallel_embedding._get_indices)."""
    org_padded = -(-org // pad) * pad
    total_padded = -(-(org_padded + added) // pad) * pad
    added_padded = total_padded - org_padded
    p_org_start = rank * (org_padded // world)
    p_org_end = p_org_start + org_padded // world
    p_add_start = org_padded + rank * added_padded // world
    p_add_end = p_add_start + added_padded // world
    return dict(org_start=min(p_org_start, org), org_end=min(p_org_end, org),
                org_pad=(p_org_end - p_org_start) - (min(p_org_end, org) - min(p_org_start, org)),
                add_start=min(p_add_start, org + added), add_end=min(p_add_end, org + added),
                rows=total_padded // world, org_padded=org_padded)


def make_vllm_embedding(ix):
    """vLLM's get_masked_input_and_mask + masked_fill_ + in-place all-reduce."""
    def emb(ids, w):
        org_mask = (ids >= ix["org_start"]) & (ids < ix["org_end"])
        add_mask = (ids >= ix["add_start"]) & (ids < ix["add_end"])
        added_offset = ix["add_start"] - (ix["org_end"] - ix["org_start"]) - ix["org_pad"]
        valid_offset = ix["org_start"] * org_mask + added_offset * add_mask
        vocab_mask = org_mask | add_mask
        masked = vocab_mask * (ids - valid_offset)
        e = F.embedding(masked.long(), w)
        e.masked_fill_((~vocab_mask).unsqueeze(-1), 0)
        dist.all_reduce(e)
        return e
    return emb


def vllm_shard(full_org, full_added, ix):
    """The rank's padded shard: [org rows, org padding, added rows, added padding]."""
    w = torch.full((ix["rows"], full_org.shape[1]), 7.0, dtype=full_org.dtype)  # junk padding
    n_org = ix["org_end"] - ix["org_start"]
    w[:n_org] = full_org[ix["org_start"]:ix["org_end"]]
    a0 = n_org + ix["org_pad"]
    added = full_added[ix["add_start"] - ix["org_padded"]:ix["add_end"] - ix["org_padded"]]
    w[a0:a0 + added.shape[0]] = added
    return w


def make_head(vocab, argmax=False, movedim=False):
    def head(h, w):
        logits = h @ w.t()
        if movedim:
            world = dist.get_world_size()
            out = torch.empty((world * logits.shape[0], logits.shape[1]), dtype=logits.dtype)
            dist.all_gather_into_tensor(out, logits)
            rows = logits.shape[0]
            full = out.view(world, rows, -1).permute(1, 0, 2).reshape(rows, -1)
        else:
            full = all_gather_last_dim(logits)
        full = full[..., :vocab]
        return full.argmax(-1) if argmax else full
    return head


def full_weight(rows, dtype=torch.float32, seed=0):
    """Same on every rank; includes -0.0, +-inf and NaN entries."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, H, generator=g)
    w[1, 0], w[2, 1], w[3, 2], w[rows - 1, 3] = -0.0, float("inf"), float("nan"), -float("inf")
    return w.to(dtype)


def head_shard(full, world, rank):
    vs = -(-full.shape[0] // world)
    w = torch.full((vs, full.shape[1]), 3.0, dtype=full.dtype)  # padding rows: junk
    part = full[rank * vs:(rank + 1) * vs]
    w[:part.shape[0]] = part
    return w


def bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def bit_equal(got, want):
    """Bit for bit (-0.0 is not +0.0), except that a NaN only has to be a NaN: its
    payload is whatever the all-reduce's float conversions make of it (gloo's bf16 sum
    gives 0x7FC0, torch's AVX2 bf16 add 0xFFFF), not part of the result's value."""
    nan = got.isnan()
    return (torch.equal(nan, want.isnan())
            and torch.equal(bits(got)[~nan], bits(want)[~nan]))


_compiled: dict = {}


def _compile(key, fn, config=STRICT):
    """One compile per case per rank process (reused across hypothesis examples)."""
    if key not in _compiled:
        commfold.clear_reports()
        _compiled[key] = torch.compile(fn, backend=commfold.backend(config=config))
    return _compiled[key]


def _embedding_cases(world, rank):
    start, end = funcol_bounds(V, world, rank)
    full = full_weight(V)
    ix = vllm_indices(V, 5, 4 * world, world, rank)
    org, added = full_weight(V, seed=1), full_weight(5, seed=2)
    return {
        "funcol-f32": (make_funcol_embedding(start, end), full[start:end].clone()),
        "funcol-bf16": (make_funcol_embedding(start, end), full[start:end].to(torch.bfloat16)),
        "vllm-f32": (make_vllm_embedding(ix), vllm_shard(org, added, ix)),
    }


def run_embeddings(id_lists):
    """Every case on every id list; returns per case (bit-equal, rewrites, collectives
    in steady state, report fingerprint)."""
    rank, world = _rank()
    out = {}
    for name, (fn, shard) in _embedding_cases(world, rank).items():
        key = ("emb", name, world)
        first = key not in _compiled
        compiled = _compile(key, fn)
        equal, logs = True, []
        for ids in id_lists:
            ids = torch.tensor(ids, dtype=torch.int64).view(2, -1)
            ref = fn(ids, shard.clone())
            with record_collectives() as log:
                got = compiled(ids, shard)
            logs.append(log.calls())
            equal &= bit_equal(got, ref)
        report = commfold.last_report() if first else None
        out[name] = dict(equal=equal, calls=logs,
                         rewrites=report.count(PASS) if report else None,
                         fingerprint=report.fingerprint() if report else None)
    return out


def boundary_ids(world):
    """Every shard boundary of both layouts, the vocab edges, out-of-range ids and the
    rows full_weight makes special (-0.0, inf, NaN; base and added vocab)."""
    ids = {-(2 ** 40), -1, 0, 1, 2, 3, V - 1, V, V + 1, V + 2, V + 3, V + 4, V + 5, 2 ** 40}
    vs = -(-V // world)
    for r in range(world + 1):
        ids |= {r * vs - 1, r * vs, r * vs + 1}
    ix = [vllm_indices(V, 5, 4 * world, world, r) for r in range(world)]
    for i in ix:
        ids |= {i["org_start"], i["org_end"] - 1, i["org_end"], i["add_start"], i["add_end"],
                i["add_start"] - 1, i["add_end"] - 1}
    return sorted(ids)


# --------------------------------------------------------------- tests

@settings(max_examples=12, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.lists(st.one_of(st.integers(-3, V + 12), st.integers(-(2 ** 62), 2 ** 62)),
                      min_size=0, max_size=16))
def test_embedding_bit_identical(ranks, extra):
    world = ranks.world_size
    ids = (boundary_ids(world) + extra + [0] * 64)[:64]  # fixed [2, 32]: no recompiles
    results = ranks.run(run_embeddings, [ids, list(reversed(ids))])
    for name in results[0]:
        per_rank = [r[name] for r in results]
        assert all(r["equal"] for r in per_rank), name
        assert all(c == 0 for r in per_rank for c in r["calls"][1:]), (name, per_rank)
        if per_rank[0]["rewrites"] is not None:  # this call compiled it
            assert [r["rewrites"] for r in per_rank] == [1] * world, name
            assert len({r["fingerprint"] for r in per_rank}) == 1, name


def run_heads(seed):
    """LM heads (funcol split/cat and in-place movedim spellings, slice to V): logits
    vs the sharded original, and collectives of the steady-state call."""
    rank, world = _rank()
    full = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    shard = head_shard(full, world, rank)
    h = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(seed))
    out = {}
    for name, fn, x in [("funcol-3d", make_head(V), h),
                        ("movedim-2d", make_head(V, movedim=True), h[0])]:
        key = ("head", name, world)
        first = key not in _compiled
        compiled = _compile(key, fn)
        ref = fn(x, shard)
        compiled(x, shard)
        report = commfold.last_report() if first else None
        with record_collectives() as log:
            got = compiled(x, shard)
        out[name] = dict(shape=tuple(got.shape) == tuple(ref.shape),
                         max_err=(got - ref).abs().max().item(), exact=torch.equal(got, ref),
                         scale=ref.abs().max().item(), calls=log.calls(),
                         rewrites=report.count(PASS) if report else None,
                         fingerprint=report.fingerprint() if report else None)
    return out


@settings(max_examples=3, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 31))
def test_lm_head_logits(ranks, seed):
    results = ranks.run(run_heads, seed)
    for name in results[0]:
        per_rank = [r[name] for r in results]
        for r in per_rank:
            assert r["shape"] and r["calls"] == 0, (name, r)
            # f32 matmul rounding: H-term dot products, relative to the logit scale
            assert r["max_err"] <= 4 * H * 2 ** -24 * r["scale"], (name, r)
        if per_rank[0]["rewrites"] is not None:
            assert [r["rewrites"] for r in per_rank] == [1] * ranks.world_size
            assert len({r["fingerprint"] for r in per_rank}) == 1


def _step(ids, emb_w, head_w, start, end, vocab):
    """A drafter step: embed, a local op, LM head, gather, slice."""
    mask = (ids < start) | (ids >= end)
    e = F.embedding((ids - start).masked_fill(mask, 0), emb_w).masked_fill(mask.unsqueeze(-1), 0.0)
    x = torch.tanh(funcol.all_reduce(e, "sum", dist.group.WORLD))
    logits = all_gather_last_dim(x @ head_w.t())
    return logits[..., :vocab]


def run_reload():
    """Steady state has no collective; every kind of weight change is seen next call."""
    torch._dynamo.reset()  # a fresh compile (not an entry of an earlier test's frame)
    rank, world = _rank()
    start, end = funcol_bounds(V, world, rank)
    emb_w = torch.nn.Parameter(full_weight(V, seed=3)[start:end].clone(), requires_grad=False)
    head_w = torch.nn.Parameter(head_shard(torch.randn(V, H), world, rank), requires_grad=False)
    fn = lambda ids, a, b: _step(ids, a, b, start, end, V)  # noqa: E731
    compiled = torch.compile(fn, backend=commfold.backend(config=STRICT))
    ids = torch.arange(-1, V + 1)
    events = []

    def call(tag):
        builds = rep_ops.build_count()
        with record_collectives() as log:
            got = compiled(ids, emb_w, head_w)
        ref = fn(ids, emb_w, head_w)
        events.append((tag, log.calls(), rep_ops.build_count() - builds,
                       bool(torch.allclose(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True))))

    call("first")
    call("steady")
    with torch.no_grad():
        emb_w.mul_(2.0)  # in-place through the parameter: version counter
    call("in-place emb")
    with torch.no_grad():
        head_w.copy_(torch.randn(head_w.shape))
    call("in-place head")
    call("steady 2")
    emb_w.data = full_weight(V, seed=4)[start:end].clone()  # a new tensor
    call("new tensor")
    head_w.data.copy_(torch.randn(head_w.shape))  # invisible to the version counter...
    rep_ops.invalidate_replicas()  # ...so the reload tells commfold, on every rank
    call("data.copy_ + invalidate")
    call("steady 3")
    with torch.inference_mode():  # inference tensors have no version counter
        emb_w = full_weight(V, seed=5)[start:end].clone()
        call("inference tensor")
        call("steady 4")
    return events


def test_steady_state_and_reload(ranks):
    results = ranks.run(run_reload)
    assert all(r == results[0] for r in results)
    ev = {tag: (calls, builds, ok) for tag, calls, builds, ok in results[0]}
    assert all(ok for _, _, ok in ev.values()), ev
    # builds: embedding 2 all-gathers (layout header, rows), LM head 1 (rows); then none
    assert ev["first"][:2] == (3, 2) and ev["steady"][:2] == (0, 0), ev
    assert ev["in-place emb"][:2] == (2, 1) and ev["in-place head"][:2] == (1, 1), ev
    assert ev["new tensor"][:2] == (2, 1), ev
    assert ev["data.copy_ + invalidate"][:2] == (3, 2), ev
    assert ev["steady 2"][:2] == ev["steady 3"][:2] == ev["steady 4"][:2] == (0, 0), ev
    assert ev["inference tensor"][:2] == (2, 1), ev


def run_threshold(max_bytes):
    torch._dynamo.reset()  # a fresh compile (not an entry of an earlier test's frame)
    rank, world = _rank()
    start, end = funcol_bounds(V, world, rank)
    shard = full_weight(V)[start:end].clone()
    fn = make_funcol_embedding(start, end)
    cfg = STRICT.replace(replicate_max_bytes=max_bytes)
    commfold.clear_reports()
    compiled = torch.compile(fn, backend=commfold.backend(config=cfg))
    ids = torch.arange(-2, V + 2).view(1, -1)
    compiled(ids, shard)
    with record_collectives() as log:
        got = compiled(ids, shard)
    report = commfold.last_report()
    return dict(rewrites=report.count(PASS), reasons=[m.reason for m in report.near_misses],
                extra=[r.extra_memory_bytes for r in report.rewrites],
                equal=bit_equal(got, fn(ids, shard)), calls=log.calls("all_reduce"))


def test_threshold_is_inclusive_and_rank_consistent(ranks2):
    full = 2 * -(-V // 2) * H * 4  # world x ceil-rows x row bytes, the same on both ranks
    at, below = ranks2.run(run_threshold, full), ranks2.run(run_threshold, full - 1)
    for r in at:
        assert r["rewrites"] == 1 and r["extra"] == [full] and r["equal"] and r["calls"] == 0, r
    for r in below:
        assert r["rewrites"] == 0 and r["equal"] and r["calls"] == 1, r
        assert any("replicate_max_bytes" in why for why in r["reasons"]), r
    assert below[0]["reasons"] == below[1]["reasons"]


def run_argmax(passes, vocab, hidden):
    torch._dynamo.reset()  # a fresh compile (not an entry of an earlier test's frame)
    rank, world = _rank()
    g = torch.Generator().manual_seed(5)
    shard = head_shard(torch.randn(vocab, hidden, generator=g), world, rank)
    fn = make_head(vocab, argmax=True)
    commfold.clear_reports()
    compiled = torch.compile(fn, backend=commfold.backend(passes=passes, strict=True))
    h = torch.randn(6, hidden, generator=g)
    compiled(h, shard)
    with record_collectives() as log:
        got = compiled(h, shard)
    report = commfold.last_report()
    return dict(rewrites={p: report.count(p) for p in passes},
                reasons=[m.reason for m in report.near_misses],
                equal=torch.equal(got, fn(h, shard)), calls=log.calls())


def test_argmax_rule(ranks2):
    """A greedy pick after a head: replicate a head under the measured crossover, leave
    a larger one to local_argmax (one tiny collective), both tokens-exact."""
    from commfold.cost import REPLICATE_BEFORE_ARGMAX, Site, limit_for

    argmax_limit = limit_for(Site(REPLICATE_BEFORE_ARGMAX)).most

    both = (PASS, "local_argmax")
    for r in ranks2.run(run_argmax, both, V, H):  # 736 B
        assert r["rewrites"] == {PASS: 1, "local_argmax": 0} and r["equal"] and r["calls"] == 0, r
    big_vocab = argmax_limit // (64 * 4) + 3  # just over the crossover
    for r in ranks2.run(run_argmax, both, big_vocab, 64):
        assert r["rewrites"] == {PASS: 0, "local_argmax": 1} and r["equal"] and r["calls"] == 1, r
        assert any("left to local_argmax" in why for why in r["reasons"]), r
    for r in ranks2.run(run_argmax, (PASS,), big_vocab, 64):  # no local_argmax: replicate
        assert r["rewrites"] == {PASS: 1} and r["equal"] and r["calls"] == 0, r


def run_head_limit(vocab, hidden, **config):
    """A head whose logits are used (no greedy pick) under the head size limit."""
    torch._dynamo.reset()  # a fresh compile (not an entry of an earlier test's frame)
    rank, world = _rank()
    g = torch.Generator().manual_seed(7)
    shard = head_shard(torch.randn(vocab, hidden, generator=g), world, rank)
    fn = make_head(vocab)
    commfold.clear_reports()
    compiled = torch.compile(fn, backend=commfold.backend(config=STRICT.replace(**config)))
    h = torch.randn(3, hidden, generator=g)
    compiled(h, shard)
    with record_collectives() as log:
        got = compiled(h, shard)
    report = commfold.last_report()
    return dict(rewrites=report.count(PASS), reasons=[m.reason for m in report.near_misses],
                close=torch.allclose(got, fn(h, shard), rtol=1e-5, atol=1e-5),
                calls=log.calls())


def test_head_limit(ranks2):
    """LM heads have a tighter, per-device limit than embeddings (a replicated head
    reads its full weight each step): on CPU the measured limit (commfold.cost),
    inclusive; replicate_head_max_bytes overrides it both ways; replicate_max_bytes
    still bounds it. Skips name the limit that applied, the same on every rank."""
    from commfold.cost import REPLICATE_HEAD, Site, limit_for

    cpu = limit_for(Site(REPLICATE_HEAD, "cpu")).most
    at, over = cpu // (64 * 4), cpu // (64 * 4) + 2  # full weight == limit, just over
    for r in ranks2.run(run_head_limit, at, 64):
        assert r["rewrites"] == 1 and r["close"] and r["calls"] == 0, r
    over_runs = ranks2.run(run_head_limit, over, 64)
    for r in over_runs:
        assert r["rewrites"] == 0 and r["close"] and r["calls"] == 1, r
        assert any(f"measured cpu head limit (replicate_head_max_bytes) {cpu} B" in why
                   for why in r["reasons"]), r
    assert over_runs[0]["reasons"] == over_runs[1]["reasons"]
    for r in ranks2.run(run_head_limit, over, 64, replicate_head_max_bytes=2 * cpu):
        assert r["rewrites"] == 1 and r["close"] and r["calls"] == 0, r
    for r in ranks2.run(run_head_limit, V, H, replicate_head_max_bytes=V * H * 4 - 1):
        assert r["rewrites"] == 0 and r["calls"] == 1, r
        assert any("> replicate_head_max_bytes" in why for why in r["reasons"]), r
    for r in ranks2.run(run_head_limit, V, H, replicate_max_bytes=V * H * 4 - 1,
                        replicate_head_max_bytes=2 * cpu):
        assert r["rewrites"] == 0 and r["calls"] == 1, r
        assert any("> replicate_max_bytes" in why for why in r["reasons"]), r


def run_not_rewritten():
    """Programs the pass must leave alone, each with the reason it records (or none)."""
    rank, world = _rank()
    start, end = funcol_bounds(V, world, rank)
    shard, table = full_weight(V)[start:end].clone(), full_weight(V, seed=9)
    emb = make_funcol_embedding(start, end)

    def others(ids, w, t):
        mask = (ids < start) | (ids >= end)
        e = F.embedding((ids - start).masked_fill(mask, 0), w).masked_fill(mask.unsqueeze(-1), 0.0)
        return F.embedding(ids.clamp(0, V - 1), t), funcol.all_reduce(e, "avg", dist.group.WORLD)

    ids = torch.arange(-2, V + 2)
    out = {}
    torch._dynamo.reset()  # a fresh compile (not an entry of an earlier test's frame)
    for name, fn, args, dynamic in [("dynamic ints", emb, (ids, shard), True),
                                    ("plain and avg", others, (ids, shard, table), None)]:
        commfold.clear_reports()
        compiled = torch.compile(fn, backend=commfold.backend(config=STRICT), dynamic=dynamic)
        # dynamic ints make both ranks' graphs identical: they would share one cache
        # entry, and a rank hitting it can race the other's saved report
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            got = compiled(*args)
        ref = fn(*args)
        report = commfold.last_report()
        same = all(torch.equal(bits(a), bits(b)) for a, b in zip(
            got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)))
        out[name] = dict(rewrites=report.count(PASS), equal=same,
                         reasons=sorted(m.reason for m in report.near_misses))
    return out


def test_leaves_other_programs_alone(ranks2):
    for r in ranks2.run(run_not_rewritten):
        assert r["dynamic ints"]["rewrites"] == 0 and r["dynamic ints"]["equal"], r
        assert r["dynamic ints"]["reasons"] == [
            "shard bounds are run-time symbols (ints made dynamic), not constants"], r
        # a plain embedding is no near-miss at all; an avg all-reduce is one
        assert r["plain and avg"]["rewrites"] == 0 and r["plain and avg"]["equal"], r
        assert r["plain and avg"]["reasons"] == ["all-reduce with op 'avg', not a sum"], r
