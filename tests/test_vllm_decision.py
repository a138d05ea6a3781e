"""Spec-decode verification methods (commfold.vllm.target.decision): commfold's greedy verify
replaces vLLM's only under strict greedy verification; every other method vLLM
defines, and any it does not know, runs vLLM's code. The methods are read from vLLM's
sources - the installed vLLM's, and each claimed release's from its wheel
(harness.vllm_sources, cached once) - and checked against the tables below,
so a release that adds a method fails here until the table (and the decision) know
it. Nothing imports vLLM."""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import vllm_sources
from commfold.vllm.target.decision import (LEFT_TO_VLLM, STRICT_GREEDY, V2Step, all_to_all_bytes,
                                    decide, decide_v2, pick_bytes, verify_method,
                                    verify_refusal)

# rejection_sample_method values (SpeculativeConfig's RejectionSampleMethod), plus
# "adaptive" (enable_adaptive_verification), as read from each release's sources
METHODS = {"0.32": ("standard", "synthetic", "block", "adaptive"),
           "0.33": ("standard", "synthetic", "block", "fly", "adaptive"),
           "0.34": ("standard", "synthetic", "block", "fly", "adaptive")}
# where the samplers branch on a method: V1's and Model Runner V2's rejection samplers
SAMPLERS = ("config/speculative.py", "v1/sample/rejection_sampler.py",
            "v1/worker/gpu/spec_decode/rejection_sampler.py")


def _release(root: Path) -> str | None:
    """'0.32' for vLLM sources at `root` (from its generated _version.py)."""
    version = root / "_version.py"
    m = re.search(r"""__version__ = version = ['"](\d+\.\d+)\.""",
                  version.read_text()) if version.exists() else None
    return m.group(1) if m else None


def _sources() -> dict[str, Path]:
    """release -> vLLM source root: the installed vLLM (found, not imported) and
    every claimed release's sources from its wheel (where it can be had)."""
    found = {}
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0])
        found[_release(root)] = root
    for sources in vllm_sources.claimed_trees():
        found.setdefault(_release(sources), sources)
    return found


def methods_in(root: Path) -> set[str]:
    """Every verification method the sources at `root` define or branch on."""
    tree = ast.parse((root / "config" / "speculative.py").read_text())
    methods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "RejectionSampleMethod" for t in node.targets):
            methods |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == \
                "enable_adaptive_verification":
            methods.add("adaptive")
    for path in SAMPLERS:
        text = (root / path).read_text() if (root / path).exists() else ""
        methods |= set(re.findall(r"""rejection_sample_method\s*==\s*["'](\w+)["']""", text))
    return methods


@pytest.mark.parametrize("release", list(METHODS))
def test_method_table_matches_vllms_sources(release):
    root = _sources().get(release)
    if root is None:
        pytest.skip(f"no vLLM {release} sources here ({vllm_sources.REASONS})")
    assert methods_in(root) == set(METHODS[release])


def _step(method: str | None) -> tuple[str | None, str]:
    """decide() for an all-greedy spec-decode step under `method`. The stand-in
    metadata says "sampled" so that a step past the verification check stops at the
    next one without vLLM (test_vllm_target_pick runs the whole decision)."""
    md = SimpleNamespace(all_greedy=False)
    return decide(md, spec=True, structured=False, logprobs_mode="raw_logprobs",
                  vocab=4096, verify=method)


CASES = sorted({(release, m) for release, ms in METHODS.items() for m in ms})


@pytest.mark.parametrize("release,method", CASES, ids=[f"{r}-{m}" for r, m in CASES])
def test_each_method_of_each_release(release, method):
    spec = SimpleNamespace(rejection_sample_method=method, enable_adaptive_verification=False)
    if method == "adaptive":
        spec = SimpleNamespace(rejection_sample_method="standard",
                               enable_adaptive_verification=True)
    read = verify_method(spec)
    assert read == method
    mode, reason = _step(read)
    if method in STRICT_GREEDY:  # past the verification check (then: "sampled")
        assert verify_refusal(read) is None and reason == "sampling (temperature > 0)"
    else:
        assert mode is None and reason.startswith(f"verification method {method}:")
        assert method in LEFT_TO_VLLM


@pytest.mark.parametrize("spec,why", [
    (None, "no speculative config"),
    (SimpleNamespace(), "no rejection_sample_method"),
    (SimpleNamespace(rejection_sample_method="lossy_future"), "lossy_future"),
    (SimpleNamespace(rejection_sample_method=None), "no rejection_sample_method"),
])
def test_an_unknown_method_runs_vllms_code(spec, why):
    mode, reason = _step(verify_method(spec))
    assert mode is None and why in reason and "verification method" in reason
    assert _step(None)[0] is None  # a caller that read no method: unknown too


STANDARD = SimpleNamespace(rejection_sample_method="standard")


@pytest.mark.parametrize("sampler,method", [
    (SimpleNamespace(synthetic_mode=False, synthetic_conditional_rates=None, use_fly=False,
                     fly_window_size=None), "standard"),  # V1, 0.33
    (SimpleNamespace(synthetic_mode=False, synthetic_conditional_rates=None),  # V1, 0.32
     "standard"),
    (SimpleNamespace(synthetic_conditional_rates=None, use_block_verification=False,
                     fly_window_size=0, enable_adaptive_verification=False), "standard"),  # V2
    (SimpleNamespace(synthetic_mode=True), "synthetic"),
    (SimpleNamespace(synthetic_conditional_rates=[0.5]), "synthetic"),
    (SimpleNamespace(use_block_verification=True), "block"),
    (SimpleNamespace(use_fly=True, fly_window_size=3), "fly"),
    (SimpleNamespace(fly_window_size=3), "fly"),
    (SimpleNamespace(enable_adaptive_verification=True), "adaptive"),
])
def test_the_built_rejection_sampler_overrules_a_standard_config(sampler, method):
    """What the runner's sampler was built to do is what runs: a config that says
    "standard" beside a sampler built for another method reads as that method."""
    assert verify_method(STANDARD, sampler) == method


def test_greedy_decoding_without_spec_ignores_the_method():
    md = SimpleNamespace(all_greedy=False)
    assert decide(md, spec=False, structured=False, logprobs_mode="raw_logprobs",
                  vocab=4096, verify="fly") == (None, "sampling (temperature > 0)")


# --- Model Runner V2: the same rules over what V2's Sampler holds -------------------

GREEDY_V2 = V2Step(temperatures=(0.0, 0.0), top_k_or_p=False, needs_processing=False,
                   logprobs=False)


@pytest.mark.parametrize("release,method", CASES, ids=[f"{r}-{m}" for r, m in CASES])
def test_each_method_on_model_runner_v2(release, method):
    """Strict greedy verification is the only one V2's hook replaces, as V1's."""
    mode, reason = decide_v2(GREEDY_V2, spec=True, structured=False, verify=method)
    if method in STRICT_GREEDY:
        assert (mode, reason) == ("verify", "all greedy")
    else:
        assert mode is None and reason.startswith(f"verification method {method}:")
    assert decide_v2(GREEDY_V2, spec=True, structured=False, verify=None)[0] is None


@pytest.mark.parametrize("change,why", [
    (dict(needs_processing=True), "logits processing"),
    (dict(needs_processing=True, processing=("penalties", "thinking_budget", "custom")),
     "logits processing: a custom"),
    (dict(temperatures=(0.0, 0.7), processing=("custom",)), "logits processing: a custom"),
    (dict(temperatures=(0.7,), logprobs=True, logprob_token_ids=True), "logprob_token_ids"),
    (dict(top_k_or_p=True), "top-k / top-p on unprocessed logits"),
    (dict(top_k_or_p=True, needs_processing=True, processing=("top_p",),
          fused_sampler=True), "top-k / top-p: V2 samples this step with its fused"),
    (dict(top_k_or_p=True, needs_processing=True, processing=("top_p",),
          split_top_p=True), "top-p: CUDA's split top-p kernels"),
    (dict(temperatures=(0.8,), top_k_or_p=True, needs_processing=True,
          processing=("top_k",), logprobs=True, num_logprobs=2, vocab=1280,
          logprobs_mode="processed_logits"), "processed logprobs after top-k / top-p"),
    (dict(logprobs=True, logprob_token_ids=True), "logprob_token_ids"),
    (dict(logprobs=True, num_logprobs=21, vocab=151936), "logprobs=21 (local up to 20)"),
    (dict(logprobs=True, num_logprobs=20, vocab=1200), "logprobs=20 with vocab 1200 < 64 k"),
    (dict(logprobs=True, logprobs_mode="other"), "logprobs_mode other"),
    (dict(trace_replay=True), "trace replay"),
    (dict(sampling_mask=True), "return_sampling_mask"),
    (dict(nan_check=True), "VLLM_COMPUTE_NANS_IN_LOGITS"),
    (dict(sampler="GPUWatermarkSampler"), "sampler GPUWatermarkSampler"),
    (dict(temperatures=()), "no requests"),
])
def test_v2_steps_that_stay_vllms(change, why):
    import dataclasses

    step = dataclasses.replace(GREEDY_V2, **change)
    mode, reason = decide_v2(step, spec=False, structured=False)
    assert mode is None and reason.startswith(why), reason
    assert decide_v2(GREEDY_V2, spec=False, structured=False) == ("greedy", "all greedy")
    # structured output: its bitmask on the shards (commfold.vllm.sample.shard_grammar), under
    # spec decoding too
    assert decide_v2(GREEDY_V2, spec=False, structured=True) == ("greedy", "all greedy")
    assert decide_v2(GREEDY_V2, spec=True, structured=True, verify="standard") == \
        ("verify", "all greedy")


@pytest.mark.parametrize("change,want", [
    (dict(temperatures=(0.0, 0.7)), ("sample", "sampled: no processing")),
    (dict(temperatures=(0.8,), needs_processing=True,
          processing=("penalties", "temperature", "min_p")),
     ("sample", "sampled: penalties, temperature, min_p")),
    (dict(needs_processing=True, processing=("penalties",)),  # greedy, penalized
     ("sample", "sampled: penalties")),
    (dict(temperatures=(1.0,), logprobs=True, num_logprobs=5, vocab=1280,
          logprobs_mode="processed_logprobs"),
     ("sample_logprobs", "sampled: no processing, logprobs=5")),
    (dict(temperatures=(1.0,), logprobs=True, num_logprobs=5, vocab=300),
     (None, "logprobs=5 with vocab 300 < 64 k")),
])
def test_v2_sampled_steps(change, want):
    """A step with a sampled request or processed logits is drawn whole from the
    shards when all its processing is local; under spec decoding V2's probabilistic
    verification is taken ("verify_sampled") with its processing in SPEC_LOCAL (no
    top-k / top-p) and logprobs as in sampled steps; with top-k / top-p too (the cut's
    bounds, commfold.shard.bounds)."""
    import dataclasses

    from commfold.vllm.target.decision import SPEC_LOCAL

    step = dataclasses.replace(GREEDY_V2, **change)
    assert decide_v2(step, spec=False, structured=False) == want
    mode, why = decide_v2(step, spec=True, structured=False, verify="standard")
    local = set(step.processing) <= set(SPEC_LOCAL) and want[0] is not None
    assert mode == ("verify_sampled" if local else None), why
    assert why == want[1], why
    cut = dataclasses.replace(step, top_k_or_p=True, needs_processing=True,
                              processing=(*step.processing, "top_k", "top_p"))
    mode, why = decide_v2(cut, spec=False, structured=False)
    if want[0] is None or step.logprobs_mode.startswith("processed"):
        assert mode is None, why
    else:
        assert mode == want[0] and "top_k, top_p" in why, why


def test_fused_sampler_steps_are_vllms_unless_the_option_says_gumbel():
    """A step V2 would draw with FlashInfer's (or XPU's) fused top-k / top-p sampler
    draws otherwise than V2's Gumbel kernel: vLLM's, unless the user's option takes it
    on the Gumbel path; the option reads from the environment through Config."""
    import dataclasses

    from commfold.config import Config
    from commfold.vllm.graph_passes import EnvError, config_from_env

    step = dataclasses.replace(GREEDY_V2, temperatures=(0.9,), top_k_or_p=True,
                               needs_processing=True, processing=("top_p",),
                               fused_sampler=True)
    mode, why = decide_v2(step, spec=False, structured=False)
    assert mode is None and "COMMFOLD_FUSED_SAMPLER_STEPS=gumbel" in why, why
    on = dataclasses.replace(step, fused_on_gumbel=True)
    assert decide_v2(on, spec=False, structured=False) == ("sample", "sampled: top_p")
    assert config_from_env({"COMMFOLD_FUSED_SAMPLER_STEPS": "gumbel"}) == \
        Config(fused_sampler_steps="gumbel")
    assert config_from_env({}).fused_sampler_steps == "vllm"
    with pytest.raises(EnvError, match="set it to vllm"):
        config_from_env({"COMMFOLD_FUSED_SAMPLER_STEPS": "flashinfer"})
    with pytest.raises(ValueError, match="fused_sampler_steps must be one of"):
        Config(fused_sampler_steps="fast")


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits",
                                  "processed_logits"])
def test_v2_greedy_logprobs_are_picked_locally(mode):
    """V2 scores its top logits as logprobs or as logits: every mode local for a greedy
    step (nothing processes its logits); under spec decoding with strict verification
    ("verify": V2 scores each verified row's token)."""
    import dataclasses

    step = dataclasses.replace(GREEDY_V2, logprobs=True, num_logprobs=20, vocab=1280,
                               logprobs_mode=mode)
    assert decide_v2(step, spec=False, structured=False) == ("logprobs", "greedy, logprobs=20")
    assert decide_v2(step, spec=True, structured=False, verify="standard") == (
        "verify", "greedy, logprobs=20")
    many = dataclasses.replace(step, num_logprobs=21)  # the greedy limits hold there too
    assert decide_v2(many, spec=True, structured=False, verify="standard")[0] is None


@pytest.mark.parametrize("k,mode,vocab,want", [
    (3, "raw_logprobs", 1280, ("logprobs", "prompt_logprobs=3")),
    (0, "processed_logits", 64, ("logprobs", "prompt_logprobs=0")),
    (-1, "raw_logprobs", 151936, (None, "prompt_logprobs=-1 (the whole vocab)")),
    (21, "raw_logprobs", 151936, (None, "prompt_logprobs=21 (local up to 20)")),
    (5, "raw_logprobs", 300, (None, "prompt_logprobs=5 with vocab 300 < 64 k")),
    (5, "other", 151936, (None, "logprobs_mode other")),
])
def test_v2_prompt_logprobs_decision(k, mode, vocab, want):
    from commfold.vllm.target.decision import decide_v2_prompt

    assert decide_v2_prompt(k, mode, vocab) == want


@pytest.mark.parametrize("rows,vocab,tp", [(1, 1024, 2), (64, 151936, 2), (256, 32000, 4)])
def test_commfold_pick_moves_less_than_batch_sharded_sampling(rows, vocab, tp):
    """V2's batch-sharded sampling all-to-alls each row's vocab shard; commfold's pick
    a 16-byte pair per row: cheaper at any vocab a model has (>= 64 columns a rank)."""
    assert pick_bytes(rows, tp) < all_to_all_bytes(rows, vocab, tp, 2)
