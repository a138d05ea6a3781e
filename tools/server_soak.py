"""A bounded soak of vLLM's OpenAI server with and without commfold: mixed traffic at a
fixed concurrency for a fixed time against each server in turn (one at a time), then
what it showed: requests served and errors, the seeded requests' answers equal across
the two servers, and each TP worker's resident memory after warm-up and at the end
(a hook's per-step state that leaked would grow it).

    python -m tools.server_soak [--seconds 180] [--concurrency 8] [--out FILE]

The traffic: request k (k = 0, 1, ...) is greedy, seeded sampled, greedy with top-5
logprobs, or streamed and aborted after two chunks (k mod 4), its prompt and seed
from k; so both servers answer the same request k the same way, whatever number each
got through. Every server flag as harness/vllm_server.py sets it (TP=2, the tiny
Llama in fp32, prefix caching on); the step log is off (users serve without it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KINDS = ("greedy", "sampled", "logprobs", "aborted")
WARMUP_S = 30


def request(k: int) -> tuple[str, dict]:
    from harness.server_requests import IGNORE_EOS, MODEL, PROMPTS

    kind = KINDS[k % 4]
    prompt = f"{PROMPTS[k % 3]} {' '.join('abcdefghij'[: k % 7])}".strip()
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8 + k % 9, extra_body=IGNORE_EOS)
    kw |= (dict(temperature=0) if kind in ("greedy", "logprobs") else
           dict(temperature=0.9, seed=1000 + k))
    if kind == "logprobs":
        kw["logprobs"] = 5
    if kind == "aborted":
        kw["max_tokens"] = 200
    return kind, kw


async def traffic(server, seconds: float, concurrency: int, results: dict, errors: list):
    """`concurrency` clients taking the next k until `seconds` pass."""
    from harness.server_requests import normalize

    client = server.async_client()
    deadline = time.monotonic() + seconds
    next_k = iter(range(10**9))

    async def one(k):
        kind, kw = request(k)
        if kind == "aborted":
            stream = await client.completions.create(stream=True, **kw)
            n = 0
            async for _ in stream:
                n += 1
                if n >= 2:
                    break
            await stream.close()
            return dict(aborted_after=n)
        r = normalize(await client.completions.create(**kw))
        c = r["choices"][0]
        return dict(text=c["text"], token_ids=c["token_ids"],
                    tokens=r["usage"]["completion_tokens"],
                    logprobs=(c["logprobs"] or {}).get("token_logprobs"))

    async def worker():
        while time.monotonic() < deadline:
            k = next(next_k)
            try:
                results[k] = await one(k)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"request {k}: {type(e).__name__}: {e}"[:300])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()  # in this loop: asyncio.run closes it next


def soak_one(server, seconds: float, concurrency: int) -> dict:
    from harness.server_requests import settled
    from harness.vllm_server import rss_kib

    results: dict[int, dict] = {}
    errors: list[str] = []
    workers = server.workers()
    t0 = time.monotonic()
    asyncio.run(traffic(server, WARMUP_S, concurrency, results, errors))
    rss_warm = {w: rss_kib(pid) for w, pid in workers.items()}
    samples = []

    async def run_and_sample():
        async def sample():
            while True:
                await asyncio.sleep(15)
                samples.append({w: rss_kib(pid) for w, pid in workers.items()})
        sampler = asyncio.ensure_future(sample())
        await traffic(server, seconds - WARMUP_S, concurrency, results, errors)
        sampler.cancel()

    asyncio.run(run_and_sample())
    after = settled(server)
    rss_end = {w: rss_kib(pid) for w, pid in workers.items()}
    kinds = [request(k)[0] for k in results]
    return dict(seconds=round(time.monotonic() - t0, 1), served=len(results),
                by_kind={k: kinds.count(k) for k in KINDS}, errors=errors,
                rss_warm_kib=rss_warm, rss_end_kib=rss_end, rss_samples_kib=samples,
                running_after=after.get("vllm:num_requests_running"),
                waiting_after=after.get("vllm:num_requests_waiting"),
                success_total=after.get("vllm:request_success_total"),
                healthy_after=server.healthy(), start_s=server.start_s, results=results)


def compare(off: dict, on: dict, atol: float = 1e-4) -> dict:
    """The requests both servers answered, and those whose answers differ."""
    common = sorted(set(off["results"]) & set(on["results"]))
    differ = []
    for k in common:
        a, b = off["results"][k], on["results"][k]
        if any(a.get(x) != b.get(x) for x in ("text", "token_ids", "aborted_after")):
            differ.append(k)
        elif a.get("logprobs") and any(abs(x - y) > atol for x, y in
                                       zip(a["logprobs"], b["logprobs"])):
            differ.append(k)
    return dict(compared=len(common), differ=differ)


def soak(tmp: Path, seconds: float = 180, concurrency: int = 8) -> dict:
    from harness.server_requests import CHAT_TEMPLATE
    from harness.tiny_models import write_model
    from harness.vllm_server import Server

    model = write_model(tmp / "model", "llama", weights=True)
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    out = {}
    for name in ("off", "on"):
        with Server(model, tmp, name, commfold=name == "on", step_log=False,
                    args=("--enable-prefix-caching",)) as s:
            out[name] = soak_one(s, seconds, concurrency)
        summary = {k: v for k, v in out[name].items() if k not in ("results", "rss_samples_kib")}
        print(name, json.dumps(summary), flush=True)
    out["compare"] = compare(out["off"], out["on"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", type=Path, help="write the whole result (JSON) here")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="server-soak-") as tmp:
        out = soak(Path(tmp), a.seconds, a.concurrency)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1, default=str))
    print("compare", json.dumps(out["compare"]))
    bad = out["compare"]["differ"] or any(out[n]["errors"] for n in ("off", "on"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
