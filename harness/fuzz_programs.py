"""Random tensor-parallel programs for differential fuzzing (tests/test_fuzz.py,
tests/test_rank_consistency.py).

A program is a list of blocks (plain dicts, drawn by hypothesis in the parent, sent
to every rank). Each block reads its own inputs and yields its own outputs, so a
program runs several rewrite sites (and distractors) in ONE compiled graph:

- ``greedy``: logits shard -> all-gather on the vocab dim (funcol, in-place
  all_gather_into_tensor + movedim, DTensor) -> optional slice to the valid vocab ->
  monotone ops (positive scale, + constant, tanh soft-cap) -> argmax / max / topk(1).
  Distractors (``bad``): a negative scale, abs, sin, ``c - x``, a second consumer of
  the gathered logits, a gather on the rows dim, topk(2, largest=False). The passes
  must leave them.
- ``norm``: partial sums -> all-reduce (funcol, funcol + explicit wait, in-place
  dist.all_reduce, DTensor Partial -> Replicate) -> optional scale of the reduced
  branch (``x * c`` or ``x / c``: Granite's residual multiplier, MiniCPM's scale_depth;
  by a 0-d tensor of x's dtype, a graph input: Gemma's ``x *= normalizer``)
  -> optional residual add (also over a leading size-1 dim: a hook's [T, H] output
  added to a [1, T, H] residual stream, or viewed back to [1, T, H] first) -> RMSNorm
  (hand-written, F.rms_norm, Gemma 1 + w) in f32 / bf16. Distractor: a max / avg /
  min reduction (not a sum): no fusion.
- ``embed``: vocab-parallel embedding (range mask, offset, lookup, zero rows,
  all-reduce) with masked_fill or where, funcol or in-place all-reduce.
- ``lm_head``: hidden @ weight shard.T -> gather -> slice -> argmax.

Each block states what it expects: rewrites per pass, how its outputs compare with
plain Inductor ("exact": bit-equal; "f32"/"bf16": relative tolerance), and whether
it is a distractor that must leave a near-miss of its pass.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from hypothesis import strategies as st

from harness.models_norm import scale_branch
from harness.gathers import all_gather_last_dim

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {"f32": 1e-5, "bf16": 2 ** -7, "logprob": 1e-6}  # relative (floor 1), vs plain Inductor
LA, FUSE, REP = "local_argmax", "fuse_allreduce_rmsnorm", "replicate_vocab_parallel"
TOPK, STATS = "local_topk", "local_softmax_stats"
PICK_PASS = {"argmax": LA, "max": LA, "topk": LA, "topk3": TOPK, "logprob": STATS}

# ------------------------------------------------------------------ strategies

# views of the reduced [T, H] value adding the leading 1 back before the residual add:
# y.unsqueeze(0), y.reshape(1, -1, H), y.view(1, T, H), y[None]
VIEWS_BACK = ("unsqueeze", "reshape", "view", "index")

seeds = st.integers(0, 2**16)

greedy_good = st.fixed_dictionaries({
    "kind": st.just("greedy"), "bad": st.none(), "seed": seeds,
    "gather": st.sampled_from(["funcol", "inplace", "dtensor"]),
    "dtype": st.sampled_from(["f32", "bf16"]),
    "rows": st.integers(2, 5), "vs": st.integers(3, 40), "pad": st.integers(0, 2),
    "ops": st.lists(st.sampled_from(["scale", "div", "add", "softcap"]), max_size=2),
    "pick": st.sampled_from(["argmax", "max", "topk", "topk3", "logprob"]),
    "ties": st.booleans(),
}).map(lambda b: {**b, "dtype": "f32", "ties": False} if b["pick"] in ("topk", "topk3") else b
       ).map(lambda b: {**b, "ops": [o for o in b["ops"] if o == "add"]}
             if b["pick"] == "logprob" else b)
# topk's choice among equal values is unspecified (so no ties, and f32, where the
# monotone ops cannot round two logits together). topk3: local_topk; logprob: the
# greedy token and its logprob, local_softmax_stats (without a scale last: Inductor
# rewrites log_softmax(c * x) into a guarded form commfold does not recognize yet).
greedy_bad = st.fixed_dictionaries({
    "kind": st.just("greedy"), "seed": seeds,
    "bad": st.sampled_from(["neg_scale", "abs", "sin", "rsub", "second_consumer",
                            "rows_gather", "topk_smallest"]),
    "gather": st.sampled_from(["funcol", "inplace"]),
    "dtype": st.just("f32"), "rows": st.integers(2, 4), "vs": st.integers(3, 30),
    "pad": st.integers(0, 2), "ops": st.just([]), "pick": st.sampled_from(["argmax", "max"]),
    "ties": st.just(False),
})
norm_block = st.fixed_dictionaries({
    "kind": st.just("norm"), "seed": seeds,
    "coll": st.sampled_from(["funcol", "funcol_wait", "inplace", "dtensor"]),
    "norm": st.sampled_from(["hand", "functional", "gemma"]),
    "dtype": st.sampled_from(["f32", "bf16"]),
    "tokens": st.integers(1, 6), "hidden": st.sampled_from([8, 16, 48]),
    "residual": st.booleans(), "eps": st.sampled_from([1e-6, 1e-5]),
    "reduce": st.sampled_from(["sum", "sum", "sum", "max", "avg", "min"]),
    # a scaled residual branch: None (none), a factor, or (spelling, c): ("div", c),
    # by a 0-d tensor ("tensor", "itensor": in place, "tdiv")
    "scale": st.one_of(st.none(), st.sampled_from([0.22, -1.5, 1.0, 2.0**-10, 12.0]),
                       st.tuples(st.just("div"), st.sampled_from([3.0, -0.5])),
                       st.tuples(st.sampled_from(["tensor", "itensor", "tdiv"]),
                                 st.sampled_from([0.22, -1.5, 45.25]))),
    # a hook's TP spelling, broadcast over a leading 1 (patterns.broadcast): the
    # residual [1, T, H] ("res1"), the all-reduced input [1, T, H] ("x1"), or the
    # reduced value viewed as [1, T, H] before the add (VIEWS_BACK, residual [1, T, H])
    "broadcast": st.sampled_from([None, None, "res1", "x1", *VIEWS_BACK]),
})
embed_block = st.fixed_dictionaries({
    "kind": st.just("embed"), "seed": seeds,
    "vocab": st.integers(2, 60), "hidden": st.sampled_from([4, 8]),
    "ids": st.tuples(st.integers(1, 3), st.integers(1, 5)),
    "spelling": st.sampled_from(["masked_fill", "where"]),
    "coll": st.sampled_from(["funcol", "inplace"]),
})
lm_head_block = st.fixed_dictionaries({
    "kind": st.just("lm_head"), "seed": seeds,
    "vocab": st.integers(3, 80), "hidden": st.sampled_from([8, 16]), "rows": st.integers(2, 4),
    "coll": st.sampled_from(["funcol", "inplace"]),
})
block = st.one_of(greedy_good, greedy_bad, norm_block, embed_block, lm_head_block)


def program(min_blocks: int = 2, max_blocks: int = 4):
    """A program: several blocks, compiled together as one graph."""
    return st.lists(block, min_size=min_blocks, max_size=max_blocks)


# ------------------------------------------------------------------ expectations

def soft_capped(b: dict) -> bool:
    """A pick behind a tanh soft cap: left alone on CPU (its tanh is Sleef's or libm's
    as Inductor tiles the kernel; passes/local_argmax.py says why)."""
    return b["kind"] == "greedy" and b["bad"] is None and "softcap" in b["ops"]


def is_distractor(b: dict) -> bool:
    return (b["kind"] == "greedy" and b["bad"] is not None) or \
        (b["kind"] == "norm" and b["reduce"] != "sum") or soft_capped(b)


def expected_rewrites(b: dict) -> dict:
    """Rewrites per pass this block must get (all passes configured)."""
    if is_distractor(b):
        return {}
    if b["kind"] == "greedy":
        return {PICK_PASS[b["pick"]]: 1}
    return {"norm": {FUSE: 1}, "embed": {REP: 1}, "lm_head": {REP: 1}}[b["kind"]]


def expected_near_miss(b: dict) -> str | None:
    """The pass that must record a near-miss for this distractor (None: no record
    is promised, e.g. a gather on the rows dim is simply not a vocab gather)."""
    if b["kind"] == "norm" and b["reduce"] != "sum":
        return FUSE
    if soft_capped(b):
        return PICK_PASS[b["pick"]]
    if b["kind"] == "greedy" and b["bad"] == "topk_smallest":
        return "local_topk"
    if b["kind"] == "greedy" and b["bad"] in ("neg_scale", "abs", "sin", "rsub",
                                              "second_consumer"):
        return LA
    return None


def compare_modes(b: dict) -> list[str]:
    """How each output of the block compares with plain Inductor."""
    if b["kind"] == "norm":
        return [b["dtype"], "exact"]  # normed (tolerance), new residual (bit-exact add)
    if b["kind"] == "greedy":
        if b["bad"] == "second_consumer":
            return ["exact", "f32"]  # tokens, sum of the logits
        if b["bad"] in ("rows_gather", "topk_smallest"):
            return ["exact"]
        if b["pick"] == "logprob":
            return ["exact", "logprob"]  # token, its logprob (another summation order)
        if b["pick"] == "topk3":
            return ["exact", "exact"]  # indices, values
        return ["exact", "exact"] if b["pick"] == "max" else ["exact"]  # ids (, values)
    return ["exact"]


# ------------------------------------------------------------------ inputs

def _gen(b, salt=0):
    return torch.Generator().manual_seed(b["seed"] * 31 + salt)


def _world_rank():
    return dist.get_world_size(), dist.get_rank()


def block_inputs(b: dict) -> list:
    """This rank's inputs for block b (every rank builds the full tensors, keeps its part)."""
    world, rank = _world_rank()
    g = _gen(b)
    if b["kind"] == "greedy":
        dtype = DTYPES[b["dtype"]]
        rows, vs = b["rows"], b["vs"]
        n = world * vs
        # distinct logits, exactly representable in bf16 (no accidental ties) ...
        order = torch.stack([torch.randperm(n, generator=g) for _ in range(rows)])
        logits = (order.float() - n / 2) / 8  # k/8, |k| <= 128: exact in bf16
        if b["ties"]:  # ... unless asked for: each row's max again in another rank's shard
            top, at = logits.max(-1)
            logits[torch.arange(rows), (at + vs) % n] = top
        shard = logits[:, rank * vs:(rank + 1) * vs].to(dtype).contiguous()
        return [shard]
    if b["kind"] == "norm":
        dtype = DTYPES[b["dtype"]]
        t, h = b["tokens"], b["hidden"]
        xs = torch.randn(world, t, h, generator=g, dtype=torch.float64)
        r = torch.randn(t, h, generator=g, dtype=torch.float64)
        # the last token's row is tiny: its mean square is about eps, so a dropped (or
        # doubled) eps moves that row's output by tens of percent, not 1e-7
        tiny = math.sqrt(b["eps"]) / 2
        xs[:, -1] *= tiny
        r[-1] *= tiny
        w = (torch.randn(h, generator=g, dtype=torch.float64) * 0.3
             + (0.0 if b["norm"] == "gemma" else 1.0))
        x, r = xs[rank], r
        if b.get("broadcast") == "x1":
            x = x.unsqueeze(0)
        elif b.get("broadcast") in ("res1", *VIEWS_BACK):
            r = r.unsqueeze(0)
        return [x.to(dtype), r.to(dtype), w.to(dtype)]
    if b["kind"] == "embed":
        v, h = b["vocab"], b["hidden"]
        vs = -(-v // world)
        table = torch.cat([torch.randn(v, h, generator=g), torch.zeros(vs * world - v, h)])
        ids = torch.randint(0, v, b["ids"], generator=g)
        ids.view(-1)[0], ids.view(-1)[-1] = 0, v - 1  # both ends of the vocab
        return [ids, table[rank * vs:(rank + 1) * vs].contiguous()]
    if b["kind"] == "lm_head":
        v, h = b["vocab"], b["hidden"]
        vs = -(-v // world)
        weight = torch.cat([torch.randn(v, h, generator=g), torch.zeros(vs * world - v, h)])
        hidden = torch.randn(b["rows"], h, generator=g)
        return [hidden, weight[rank * vs:(rank + 1) * vs].contiguous()]
    raise ValueError(b["kind"])


# ------------------------------------------------------------------ block code

_MESH = None


def mesh():
    """The 1-D device mesh, made outside compiled code (dynamo cannot trace its creation)."""
    global _MESH
    if _MESH is None:
        from torch.distributed.tensor import init_device_mesh

        _MESH = init_device_mesh("cpu", (dist.get_world_size(),))
    return _MESH


def _gather_vocab(shard, how):
    world = dist.get_world_size()
    if how == "funcol":
        return all_gather_last_dim(shard)
    if how == "inplace":
        rows, vs = shard.shape
        out = torch.empty(world * rows, vs, dtype=shard.dtype)
        dist.all_gather_into_tensor(out, shard)
        return out.view(world, rows, vs).movedim(0, 1).reshape(rows, world * vs)
    if how == "dtensor":
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(shard, _MESH, [Shard(1)], run_check=False).full_tensor()
    raise ValueError(how)


def _greedy(b, shard):
    world = dist.get_world_size()
    bad = b["bad"]
    if bad == "rows_gather":  # gathered on dim 0: not a vocab gather
        full = funcol.all_gather_tensor(shard, 0, dist.group.WORLD)
        return (full.argmax(-1),)
    x = _gather_vocab(shard, b["gather"])
    valid = world * b["vs"] - b["pad"]
    if b["pad"]:
        x = x[:, :valid]
    for op in b["ops"]:
        if op == "scale":
            x = x * 0.75
        elif op == "div":
            x = x / 1.3
        elif op == "add":
            x = x + 2.0
        elif op == "softcap":
            x = torch.tanh(x / 30.0) * 30.0
    if bad == "neg_scale":
        x = x * -0.5
    elif bad == "abs":
        x = x.abs()
    elif bad == "sin":
        x = torch.sin(x)
    elif bad == "rsub":
        x = 1.0 - x
    elif bad == "second_consumer":
        return x.argmax(-1), x.float().sum(-1)
    elif bad == "topk_smallest":  # local_topk takes the k largest only
        return (torch.topk(x, 2, dim=-1, largest=False).indices,)
    if b["pick"] == "argmax":
        return (x.argmax(-1),)
    if b["pick"] == "max":
        v, i = x.max(dim=-1)
        return i, v
    if b["pick"] == "topk3":
        v, i = torch.topk(x, 3, dim=-1)
        return i, v
    if b["pick"] == "logprob":
        tok = x.argmax(-1)
        return tok, torch.log_softmax(x.float(), -1).gather(-1, tok[:, None])
    return (torch.topk(x, 1, dim=-1).indices.squeeze(-1),)


def _all_reduce(x, coll, op, copy=True):
    if coll == "funcol":
        return funcol.all_reduce(x, op, dist.group.WORLD)
    if coll == "funcol_wait":
        return funcol.wait_tensor(funcol.all_reduce(x, op, dist.group.WORLD))
    if coll == "inplace":
        y = x * 1 if copy else x  # in place on an intermediate, not on a graph input
        dist.all_reduce(y, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                               "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}[op])
        return y
    if coll == "dtensor":
        from torch.distributed.tensor import DTensor, Partial, Replicate

        d = DTensor.from_local(x, _MESH, [Partial(op)], run_check=False)
        return d.redistribute(_MESH, [Replicate()]).to_local()
    raise ValueError(coll)


def _rms(h, w, eps, how):
    if how == "functional":
        return F.rms_norm(h, (h.shape[-1],), w, eps)
    hf = h.float()
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if how == "gemma":
        return (n * (1.0 + w.float())).type_as(h)
    return w * n.to(h.dtype)  # hand-written (Llama): cast back, then weight


def _norm(b, x, r, w):
    coll = b["coll"] if b["reduce"] != "avg" or b["coll"] != "inplace" else "funcol"
    y = _all_reduce(x, coll, b["reduce"])
    scale = b.get("scale")
    if isinstance(scale, (tuple, list)):  # (spelling, c)
        y = scale_branch(y, scale[1], scale[0])
    elif scale is not None:
        y = y * scale
    if b.get("broadcast") in VIEWS_BACK and b["residual"]:
        y = _view_back(y, b["broadcast"])
    if b["residual"]:
        y = y + r
    return _rms(y, w, b["eps"], b["norm"]), y


def _view_back(y, how):
    """The reduced [T, H] value viewed as [1, T, H] before the residual add."""
    if how == "unsqueeze":
        return y.unsqueeze(0)
    if how == "reshape":
        return y.reshape(1, -1, y.shape[-1])
    if how == "view":
        return y.view(1, *y.shape)
    return y[None]  # "index"


def _embed(b, ids, shard):
    vs, rank = shard.shape[0], dist.get_rank()
    lo, hi = rank * vs, (rank + 1) * vs
    outside = (ids < lo) | (ids >= hi)
    if b["spelling"] == "masked_fill":
        local = (ids - lo).masked_fill(outside, 0)
        e = F.embedding(local, shard).masked_fill(outside.unsqueeze(-1), 0.0)
    else:
        local = torch.where(outside, 0, ids - lo)
        e = torch.where(outside.unsqueeze(-1), 0.0, F.embedding(local, shard))
    return (_all_reduce(e, b["coll"], "sum", copy=False),)


def _lm_head(b, hidden, shard):
    logits = _gather_vocab(hidden @ shard.t(), b["coll"])
    return (logits[:, : b["vocab"]].argmax(-1),)


_RUN = {"greedy": _greedy, "norm": _norm, "embed": _embed, "lm_head": _lm_head}


def n_inputs(b: dict) -> int:
    return {"greedy": 1, "norm": 3, "embed": 2, "lm_head": 2}[b["kind"]]


def build(blocks: list[dict]):
    """fn(*inputs) -> tuple of every block's outputs, in block order."""
    if any(b.get("gather") == "dtensor" or b.get("coll") == "dtensor" for b in blocks):
        mesh()

    def program(*args):
        outs, i = [], 0
        for b in blocks:
            k = n_inputs(b)
            outs.extend(_RUN[b["kind"]](b, *args[i:i + k]))
            i += k
        return tuple(outs)

    return program


def inputs(blocks: list[dict]) -> list:
    return [t for b in blocks for t in block_inputs(b)]


# ------------------------------------------------------------------ running (on a rank)

def _same(a, b, mode):
    if mode == "exact":
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), 0.0
    a64, b64 = a.double(), b.double()
    rel = ((a64 - b64).abs() / b64.abs().clamp_min(1.0)).max().item() if a.numel() else 0.0
    return a.dtype == b.dtype and a.shape == b.shape and rel <= TOLERANCE[mode], rel


def compare(blocks, got, want) -> list[str]:
    """Mismatches between commfold's outputs and plain Inductor's, block by block."""
    bad, k = [], 0
    for i, b in enumerate(blocks):
        for mode in compare_modes(b):
            ok, rel = _same(got[k], want[k], mode)
            if not ok:
                bad.append(f"block {i} ({b}) output {k} [{mode}]: rel diff {rel:g}")
            k += 1
    if k != len(got) or len(got) != len(want):
        bad.append(f"{len(got)} outputs ({len(want)} from Inductor), {k} expected")
    return bad


def run_program(blocks, backend=None, before_compile=None) -> dict:
    """Compile `blocks` as one program with commfold and with plain Inductor, run both
    on this rank's inputs, and say what differed and what commfold decided."""
    import commfold

    fn = build(blocks)
    args = inputs(blocks)
    torch._dynamo.reset()
    want = torch.compile(fn, backend="inductor")(*[a.clone() for a in args])
    torch._dynamo.reset()
    seen = len(commfold.reports())
    if before_compile is not None:
        before_compile()
    from torch._dynamo.utils import counters

    counters.clear()
    # the passes must run on every program: a program whose lowered form an earlier one
    # had would be served from Inductor's caches (rewritten then, its report not ours)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        # the cost rule off: a 16-bit site on gloo is rewritten too, so its rewrite is checked
        got = torch.compile(fn, backend=backend or commfold.backend(fuse_cost_rule=False))(
            *[a.clone() for a in args])
    reps = commfold.reports()[seen:]
    # what Dynamo did when no graph reached commfold (a frame run eagerly, a break)
    dynamo = {k: dict(v) for k, v in counters.items() if k in ("stats", "unimplemented",
                                                                  "graph_break")} \
        if not reps else {}
    counts, near = {}, {}
    for r in reps:
        for w in r.rewrites:
            counts[w.pass_name] = counts.get(w.pass_name, 0) + 1
        for m in r.near_misses:
            near[m.pass_name] = near.get(m.pass_name, 0) + 1
    return {"mismatches": compare(blocks, got, want), "counts": counts, "near": near,
            "errors": [f"{e.pass_name}: {e.error}" for r in reps for e in r.errors],
            "fingerprints": [r.fingerprint() for r in reps], "graphs": len(reps),
            "from_cache": any(r.from_cache for r in reps), "dynamo": dynamo}


def run_programs(programs, **kw) -> list[dict]:
    """run_program for each program (one rank-pool call for many programs)."""
    return [run_program(p, **kw) for p in programs]


def expected_counts(blocks) -> dict:
    total = {}
    for b in blocks:
        for k, v in expected_rewrites(b).items():
            total[k] = total.get(k, 0) + v
    return total


def check(blocks, results: list[dict]) -> list[str]:
    """Problems with one program's per-rank results (empty when all is well)."""
    problems = []
    want = expected_counts(blocks)
    misses = {}
    for b in blocks:
        p = expected_near_miss(b)
        if p:
            misses[p] = misses.get(p, 0) + 1
    for rank, r in enumerate(results):
        problems += [f"rank {rank}: {m}" for m in r["mismatches"]]
        if r["errors"]:
            problems.append(f"rank {rank}: pass errors {r['errors']}")
        if r["counts"] != want:
            problems.append(f"rank {rank}: rewrites {r['counts']} != expected {want} "
                            f"({r['graphs']} graph(s), from cache: {r['from_cache']}"
                            + (f", Dynamo: {r['dynamo']}" if r.get("dynamo") else "") + ")")
        for p, n in misses.items():
            if r["near"].get(p, 0) < n:
                problems.append(f"rank {rank}: {r['near'].get(p, 0)} near-miss(es) of {p}, "
                                f"expected at least {n}")
    if any(r["fingerprints"] != results[0]["fingerprints"] for r in results):
        problems.append(f"fingerprints differ across ranks: {[r['fingerprints'] for r in results]}")
    return problems
