"""The target model's logits + token pick of one engine step, vLLM's way vs commfold's
target pick, at TP=2 inside vLLM's own TP group (its CPU shared-memory
communicator, or --gloo for its torch.distributed fallback), on vLLM's real
ParallelLMHead + LogitsProcessor (V=151936, hidden 1024, bf16 by default) and its
real Sampler:

- vLLM: compute_logits (LM-head matmul + all-gather of the logits) + Sampler;
- commfold: compute_logits on this rank's shard + commfold.vllm.target.target_pick's pick
  (greedy: one (value, index) pair per row per rank; logprobs=k: two small
  all-gathers);
- greedy also: vLLM's hand-written get_top_tokens (what vLLM uses for drafters,
  not for the target), the strongest alternative in vLLM itself.

    python -m benchmarks.bench_target_pick                 # B = 1 8 64, greedy / logprobs=5 / 20
    python -m benchmarks.bench_target_pick --batch 64 --modes greedy --gloo
    python -m benchmarks.bench_target_pick --pick-only --batch 1 2 4 8 16 --modes greedy

--pick-only times the pick alone, from this rank's logits shard (vLLM: the gather of
the logits and its Sampler; commfold: the target pick's collectives and output), in
paired rounds (harness.bench.paired_rounds), with the ratio's quartiles: the LM-head
matmul both ways share is left out, so the difference the cost rule weighs
(commfold.cost, the target pick's entries) is not lost in its noise.

Prints rank 0's median ms per step (LM-head matmul included: it is the same work
both ways), the speed-up, whether the outputs agree (tokens exactly; logprob ids
and ranks exactly, values within 2e-5), and the bytes each rank put into
collectives per step. Engine throughput is bench_vllm_engine.py's (helper
"engine"'s) job; this isolates the step's pick.
"""
from __future__ import annotations

import argparse
import os
import statistics
from types import SimpleNamespace

import torch

from commfold.distributed.ranks import run_on_ranks
from harness.bench import comm_of_variants, paired_ratio, paired_rounds, time_side_by_side

MODES = {"greedy": None, "logprobs=5": 5, "logprobs=20": 20}


def measure(batches, modes, vocab, hidden, dtype, iters, shm, pick_only=False):
    from vllm.platforms import current_platform

    from harness import vllm_step as vs
    from harness.vllm_tp import init_vllm_tp
    from commfold.vllm.target.target_pick import Picker

    current_platform.register_triton_kernel_overrides()
    init_vllm_tp(2, shm=shm)
    os.environ["COMMFOLD_PICK_COST_RULE"] = "0"  # the pick timed, not the rule's choice
    dt = getattr(torch, dtype)
    model = vs.TinyLM(vocab, dt, seed=0, ties=False, hidden=hidden)
    runner = vs.runner(model, None)
    picker = Picker.build(runner)
    runner._commfold_picker = picker
    picker.scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens={},
                                                 has_structured_output_requests=False)
    rows = []
    for b in batches:
        h = vs.hidden(b, dt, seed=b, ties=False, width=hidden)
        for mode in modes:
            md = vs.metadata(b, MODES[mode], vocab)
            runner.input_batch.sampling_metadata = md

            def vllm_step(x, md=md):
                return runner.sampler(logits=model.compute_logits(x), sampling_metadata=md)

            def commfold_step(x):
                picker.in_execute = True
                model.compute_logits(x)
                pending, picker.pending = picker.pending, None
                return picker.sample(pending, None)

            variants = {"vllm": vllm_step, "commfold": commfold_step}
            same = _same(commfold_step(h), vllm_step(h))
            if pick_only:
                rows.append(_pick_only(picker, runner, model, h, md, mode, iters) | {"same": same})
                continue
            if mode == "greedy":
                variants["get_top_tokens"] = lambda x: model.logits_processor.get_top_tokens(
                    model.lm_head, x)
            t = time_side_by_side(variants, (h,), iters)
            comm = comm_of_variants(variants, (h,))
            rows.append(dict(B=b, mode=mode, same=same, t=t, comm=comm))
    return rows


def _pick_only(picker, runner, model, h, md, mode, iters) -> dict:
    """The pick from a precomputed shard, both ways, in paired rounds."""
    shard = picker.head.local_logits(h)
    pick_mode = "logprobs" if MODES[mode] is not None else "greedy"

    def vllm_pick(x):
        return runner.sampler(logits=picker.gather(x), sampling_metadata=md)

    def commfold_pick(x):
        from commfold.vllm.target.target_pick import _Pending

        return picker.sample(_Pending(x, pick_mode, picker.pick(x, pick_mode)), None)

    variants = {"vllm": vllm_pick, "commfold": commfold_pick}
    times = paired_rounds(variants, (shard,), iters)
    return dict(B=h.shape[0], mode=mode, t={k: statistics.median(v) for k, v in times.items()},
                ratio=paired_ratio(times, "vllm", "commfold"),
                comm=comm_of_variants(variants, (shard,)))


def _same(a, b) -> bool:
    if not torch.equal(a.sampled_token_ids, b.sampled_token_ids):
        return False
    x, y = a.logprobs_tensors, b.logprobs_tensors
    if x is None or y is None:
        return x is None and y is None
    return (torch.equal(x.logprob_token_ids, y.logprob_token_ids)
            and torch.equal(x.selected_token_ranks, y.selected_token_ranks)
            and torch.allclose(x.logprobs, y.logprobs, rtol=0, atol=2e-5))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--gloo", action="store_true", help="vLLM's torch.distributed fallback")
    p.add_argument("--pick-only", action="store_true",
                   help="the pick alone, from the logits shard (paired rounds)")
    a = p.parse_args(argv)
    rows = run_on_ranks(measure, 2, a.batch, a.modes, a.vocab, a.hidden, a.dtype, a.iters,
                        not a.gloo, a.pick_only, timeout=3600)[0]
    if a.pick_only:
        return _print_pick_only(rows, a)
    comm = "gloo" if a.gloo else "vLLM shm"
    print(f"target logits + pick, TP=2 ({comm}), V={a.vocab}, hidden {a.hidden}, {a.dtype}, "
          f"median of {a.iters} (rank 0)")
    print("| mode | B | vLLM (ms) | commfold (ms) | speed-up | same | bytes/rank/step: vLLM "
          "| commfold | vLLM get_top_tokens (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, c = r["t"], r["comm"]
        top = f"{t['get_top_tokens'] * 1e3:.2f}" if "get_top_tokens" in t else ""
        print(f"| {r['mode']} | {r['B']} | {t['vllm'] * 1e3:.2f} | {t['commfold'] * 1e3:.2f} | "
              f"{t['vllm'] / t['commfold']:.2f}x | {r['same']} | {c['vllm']['bytes']} | "
              f"{c['commfold']['bytes']} | {top} |")



def _print_pick_only(rows, a) -> None:
    comm = "gloo" if a.gloo else "vLLM shm"
    print(f"target pick alone (no LM head), TP=2 ({comm}), V={a.vocab}, {a.dtype}, "
          f"paired rounds (slowest rank per block)")
    print("| mode | B | vLLM (ms) | commfold (ms) | speed-up (q1-q3) | same | bytes/rank/step: "
          "vLLM | commfold |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, c, q = r["t"], r["comm"], r["ratio"]
        print(f"| {r['mode']} | {r['B']} | {t['vllm'] * 1e3:.3f} | {t['commfold'] * 1e3:.3f} | "
              f"{q['median']:.2f}x ({q['q1']:.2f}-{q['q3']:.2f}) | {r['same']} | "
              f"{c['vllm']['bytes']} | {c['commfold']['bytes']} |")


if __name__ == "__main__":
    main()
