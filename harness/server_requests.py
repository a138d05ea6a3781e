"""The requests the server tests send, through the `openai` client, to a vLLM server
with commfold and to one without (harness/vllm_server.py), and how their responses
are compared: per request the same tokens, texts, finish reasons and usage, the
logprobs to the forward's rounding (commfold's fused norm sums in another order), the
same HTTP status and message for bad input.

run_suite(server) sends them one at a time (each step's batch is then the same on
both servers), then the concurrent parts: a burst, a batch of sampled streams with one
aborted, a stream whose client disconnects; it returns name -> normalized response
and the server's counters around each part.
"""
from __future__ import annotations

import asyncio
import math
import time

PROMPTS = ["the quick brown fox", "tensor parallel inference", "hello world, commfold"]
# ~200 tokens of the tiny tokenizer (one a letter): past max-num-batched-tokens (64 in the
# server tests), so its prefill is chunked
LONG_PROMPT = " ".join(["a b c d e f g h i j"] * 20)
# the suite's models take max_position_embeddings and their servers --max-model-len
# SUITE_MAX_MODEL_LEN: room for a stream that is aborted (VICTIM_TOKENS long) to still
# run when its abort reaches the engine. The API server passes the engine's outputs on
# behind the engine: on 2 shared cores a 200-token victim of V1 ran 74 tokens past its
# client's close, once to its end
SUITE_MAX_MODEL_LEN = 1024
VICTIM_TOKENS = 1000
TOO_LONG_PROMPT = " ".join(["a b c d e f g h i j"] * 120)  # ~1200 tokens > max-model-len
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
JSON_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                                "name": {"type": "string"}},
               "required": ["n", "name"]}
MODEL = "m"
# every answer carries its token ids, and logprobs name tokens by id ("token_id:N"):
# the tiny tokenizer has ~300 tokens of the model's 1000, so most ids decode to "" (a
# text alone would hide a different token, and text keys of top logprobs collide)
IGNORE_EOS = {"ignore_eos": True, "return_token_ids": True}
BY_ID = {**IGNORE_EOS, "return_tokens_as_token_ids": True}
_DROP = {"id", "created", "system_fingerprint", "service_tier", "prompt_token_ids_details"}


def normalize(response) -> dict:
    """A response's content: the client's model dumped, its per-call fields dropped."""
    d = response.model_dump() if hasattr(response, "model_dump") else response
    return _strip(d)


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in _DROP}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def differences(a, b, atol: float, where: str = "") -> list[str]:
    """Where two normalized responses differ: floats beyond atol (the logprobs),
    anything else not equal. A top-logprobs dict's keys must be equal except entries
    within atol of the smallest kept value (a near tie at the cut)."""
    if isinstance(a, float) and isinstance(b, float):
        same = (math.isinf(a) and a == b) or abs(a - b) <= atol
        return [] if same else [f"{where}: {a} != {b}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            if _top_logprobs_near_cut(a, b, atol):
                return []
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], atol, f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, atol,
                                                                              f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _top_logprobs_near_cut(a: dict, b: dict, atol: float) -> bool:
    """Two {token: logprob} dicts whose differing keys are all near the smallest kept
    value (ties at the top-k cut that rounding decides)."""
    if not all(isinstance(v, float) for v in [*a.values(), *b.values()]) or len(a) != len(b):
        return False
    cut = min(min(a.values()), min(b.values()))
    odd = [(a | b)[k] for k in set(a) ^ set(b)]
    common = set(a) & set(b)
    return all(v - cut <= 2 * atol for v in odd) and all(
        abs(a[k] - b[k]) <= atol for k in common)


def error_of(call) -> dict:
    """The HTTP status and message of a call the server refuses (or its response)."""
    import openai

    try:
        return dict(ok=normalize(call()))
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        return dict(status=e.status_code, message=body.get("message", str(e.body)),
                    type=body.get("type"))


# --- one request at a time ----------------------------------------------------------

def sequential(client) -> dict:
    """name -> normalized response of each single request (see the module docstring)."""
    cmpl, chat = client.completions.create, client.chat.completions.create
    out = {}

    def c(name, **kw):
        out[name] = normalize(cmpl(model=MODEL, **kw))

    c("greedy", prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    for i in (1, 2):  # what the edge-but-valid requests below must answer
        c(f"greedy_{i}", prompt=PROMPTS[i], max_tokens=8, temperature=0,
          extra_body=IGNORE_EOS)
    c("sampled", prompt=PROMPTS[1], max_tokens=12, temperature=0.8, seed=7,
      extra_body=IGNORE_EOS)
    c("n2", prompt=PROMPTS[2], max_tokens=10, temperature=0.9, seed=5, n=2,
      extra_body=IGNORE_EOS)
    # a stop string: the greedy answer's last 3 characters, so the same request stops
    # before them (the same text on both servers, or "greedy" differs first)
    stop = out["greedy"]["choices"][0]["text"].strip()[-3:] or "fox"
    c("stop", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
      extra_body=IGNORE_EOS)
    out["stop"]["stop_string"] = stop
    c("echo_prompt_logprobs", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
      logprobs=3, extra_body=BY_ID)
    c("logprobs_sampled", prompt=PROMPTS[2], max_tokens=8, temperature=0.7, seed=21,
      logprobs=5, extra_body=BY_ID)
    out["chat_top_logprobs"] = normalize(chat(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=5, extra_body=BY_ID))
    out["chat_sampled"] = normalize(chat(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8,
        temperature=1.0, seed=8, extra_body=IGNORE_EOS))
    # logit_bias: one token pushed past every other (greedy then emits only it)
    tid = out["greedy"]["choices"][0]["token_ids"][0]
    biased = (tid + 7) % 250
    c("logit_bias", prompt=PROMPTS[0], max_tokens=6, temperature=0,
      logit_bias={str(biased): 100}, extra_body=IGNORE_EOS)
    out["logit_bias"]["biased"] = biased
    c("penalties", prompt=PROMPTS[1], max_tokens=12, temperature=0.8, seed=9,
      presence_penalty=0.5, frequency_penalty=0.5,
      extra_body=dict(IGNORE_EOS, repetition_penalty=1.3))
    c("min_tokens", prompt=PROMPTS[2], max_tokens=12, temperature=0.9, seed=10,
      extra_body=dict(min_tokens=8, return_token_ids=True))
    c("top_k_min_p", prompt=PROMPTS[0], max_tokens=10, temperature=0.9, seed=12,
      extra_body=dict(IGNORE_EOS, top_k=20, min_p=0.05))
    # edge but valid: a top_p that keeps one token, a near-zero temperature with top_k=1
    c("top_p_tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0.8, seed=13, top_p=1e-9,
      extra_body=IGNORE_EOS)
    c("temp_tiny_top_k1", prompt=PROMPTS[2], max_tokens=8, temperature=1e-6, seed=14,
      extra_body=dict(IGNORE_EOS, top_k=1))
    out["json_schema"] = error_of(lambda: chat(
        model=MODEL, messages=[{"role": "user", "content": "give a json object"}],
        max_tokens=40, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "o", "schema": JSON_SCHEMA}}))
    # streaming: the same request as "sampled", chunks joined
    stream = cmpl(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.8, seed=7,
                  stream=True, extra_body=IGNORE_EOS)
    out["stream"] = dict(text="".join(ch.choices[0].text for ch in stream if ch.choices))
    # prefix cache and chunked prefill: a ~200-token prompt twice (the second one hits
    # the cache), then greedy, with the first four tokens' logprobs
    c("long_prompt", prompt=LONG_PROMPT, max_tokens=6, temperature=0, logprobs=2,
      extra_body=BY_ID)
    c("long_prompt_again", prompt=LONG_PROMPT, max_tokens=6, temperature=0, logprobs=2,
      extra_body=BY_ID)
    return out


def bad_inputs(client) -> dict:
    """name -> the status and message of each bad request (or its response, when the
    server takes it)."""
    cmpl, chat = client.completions.create, client.chat.completions.create
    base = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
    cases = {
        "logprobs_too_many": lambda: cmpl(**base, logprobs=50),
        "top_logprobs_too_many": lambda: chat(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            logprobs=True, top_logprobs=50),
        "top_k_negative": lambda: cmpl(**base, extra_body=dict(top_k=-5)),
        "min_p_above_one": lambda: cmpl(**base, extra_body=dict(min_p=1.5)),
        "logit_bias_past_vocab": lambda: cmpl(**base, logit_bias={"99999": 5}),
        "temperature_negative": lambda: cmpl(**base, temperature=-1.0),
        "prompt_too_long": lambda: cmpl(model=MODEL, prompt=TOO_LONG_PROMPT, max_tokens=4),
    }
    return {name: error_of(call) for name, call in cases.items()}


# --- concurrent requests ----------------------------------------------------------------

def burst_requests(n: int = 8) -> list[dict]:
    """n requests sent at once: greedy, seeded sampled, greedy with logprobs in turn."""
    reqs = []
    for i in range(n):
        kw = dict(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=10, extra_body=IGNORE_EOS)
        kind = i % 3
        kw |= (dict(temperature=0) if kind == 0 else
               dict(temperature=0.8, seed=100 + i) if kind == 1 else
               dict(temperature=0, logprobs=3, extra_body=BY_ID))
        reqs.append(kw)
    return reqs


async def _burst(aclient, reqs):
    outs = await asyncio.gather(*(aclient.completions.create(**kw) for kw in reqs))
    await aclient.close()  # in this loop: asyncio.run closes it next
    return [normalize(o) for o in outs]


async def streams(aclient, kws: list[dict], stop_after: dict[int, int] | None = None):
    """The completions `kws` streamed at once; the client of stream i in `stop_after`
    stops reading after that many chunks and closes it (an abort). Per stream: its
    text, token ids (where the request asks for them: return_token_ids) and chunks
    read, or {"aborted_after": chunks}. Closes the client."""
    stop_after = stop_after or {}

    async def read(i, kw):
        stream = await aclient.completions.create(stream=True, **kw)
        parts, ids, n = [], [], 0
        async for ch in stream:
            n += 1
            parts.extend(c.text for c in ch.choices)
            ids.extend(t for c in ch.choices for t in getattr(c, "token_ids", None) or ())
            if i in stop_after and n >= stop_after[i]:
                await stream.close()
                return dict(aborted_after=n)
        return dict(text="".join(parts), token_ids=ids, chunks=n)

    out = await asyncio.gather(*(read(i, kw) for i, kw in enumerate(kws)))
    await aclient.close()  # in this loop: asyncio.run closes it next
    return out


def _abort_in_batch(server):
    """Four seeded sampled streams and a fifth (long) one whose client stops reading
    after two chunks and closes the stream: the four complete."""
    kws = [dict(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=16, temperature=0.9,
                seed=200 + i, extra_body=IGNORE_EOS) for i in range(4)]
    victim = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=VICTIM_TOKENS, temperature=0.9,
                  seed=299,
                  extra_body=IGNORE_EOS)
    return asyncio.run(streams(server.async_client(), [*kws, victim], {4: 2}))


def _disconnect_mid_stream(server) -> int:
    """A raw HTTP stream read for a few events, then its socket closed (the client
    gone, not a polite close): returns the events read."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(dict(
        model=MODEL, prompt=PROMPTS[1], max_tokens=VICTIM_TOKENS, temperature=0.9, seed=300,
        stream=True, ignore_eos=True)), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = 0
    while events < 3:
        line = resp.fp.readline()
        events += line.startswith(b"data:")
    conn.sock.close()
    conn.close()
    return events


def settled(server, timeout: float = 120) -> dict[str, float]:
    """The server's counters once no request runs or waits (an aborted request's
    end reaches the engine a moment after its client left)."""
    t0 = time.monotonic()
    while True:
        m = server.metrics()
        idle = m.get("vllm:num_requests_running", 0) == 0 and \
            m.get("vllm:num_requests_waiting", 0) == 0
        if idle or time.monotonic() - t0 > timeout:
            return m
        time.sleep(0.5)


COUNTERS = ("vllm:request_success_total", "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def counted(server, out: dict):
    """count(part, fn): out[part] = fn(), and out["counters"][part] = the change in
    vLLM's counters over it (once the server is idle again), its seconds, and what
    still runs or waits after it."""
    out.setdefault("counters", {})

    def count(part, fn):
        before = settled(server)
        t0 = time.perf_counter()
        out[part] = fn()
        after = settled(server)
        out["counters"][part] = dict(
            seconds=round(time.perf_counter() - t0, 1),
            **{k.removeprefix("vllm:"): after.get(k, 0) - before.get(k, 0) for k in COUNTERS},
            running=after.get("vllm:num_requests_running"),
            waiting=after.get("vllm:num_requests_waiting"))
    return count


def run_suite(server) -> dict:
    """Everything above against one server, each part counted (counted())."""
    client = server.client()
    out: dict = {}
    count = counted(server, out)

    count("sequential", lambda: sequential(client))
    count("bad", lambda: bad_inputs(client))
    count("after_bad", lambda: normalize(client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
        extra_body=IGNORE_EOS)))
    reqs = burst_requests()
    count("burst", lambda: asyncio.run(_burst(server.async_client(), reqs)))
    count("burst_alone", lambda: [normalize(client.completions.create(**kw)) for kw in reqs])
    count("abort_in_batch", lambda: _abort_in_batch(server))
    count("disconnect", lambda: _disconnect_mid_stream(server))
    count("after_faults", lambda: normalize(client.completions.create(**reqs[1])))
    return out
