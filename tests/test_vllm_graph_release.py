"""The release tier's graph step: commfold's graph passes on a vLLM release's own model
pieces (vLLM >= 0.34, in the tier's venv: tools/vllm_release_tier.py), on 2 gloo ranks.

vLLM 0.34's VocabParallelEmbedding, RMSNorm (its ``vllm.ir`` ops:
``vllm_ir.rms_norm`` and ``vllm_ir.fused_add_rms_norm.maybe_inplace``, run by their
native implementation: the CUDA wheel's ``vllm._C`` does not load on CPU) each fed by
its all-reduce (``tensor_model_parallel_all_reduce`` as the CUDA platform spells it:
the ``vllm.all_reduce`` custom op), then its ParallelLMHead + LogitsProcessor
(``vllm.all_gather``) + argmax, compiled once with plain Inductor and once with
commfold's ``fuse_allreduce_rmsnorm`` and ``local_argmax``: each norm site fused once,
the pick made local, no vocab-wide gather at run time, and the same tokens as the
unrewritten program (and eager vLLM), normed output and residual within 1e-5 of the
largest (f32). The counts go to the tier's JSON (``record_property("graph", ...)``)
for docs/vllm-compat.md."""
from __future__ import annotations

import json

import pytest

from commfold.vllm.compat import releases
from commfold.vllm.compat.releases import installed_vllm

_found = installed_vllm()
if ((releases.parse(_found[1]) if _found else None) or ()) < (0, 34):
    pytest.skip(f"needs vLLM >= 0.34 (the release tier's venv); here: "
                f"{' '.join(_found) if _found else 'no vLLM'}", allow_module_level=True)

H, V, EPS = 64, 1000, 1e-6  # V pads to 1024 (64 padding rows, on rank 1's shard)
FUSED, PICK = "fuse_allreduce_rmsnorm", "local_argmax"
NORMS = 3  # all-reduce + RMSNorm sites: the embedding's, two layer outputs
_state: dict = {}


def _setup():
    """vLLM's TP group on this gloo rank, collectives as vLLM's custom ops (what the
    CUDA platform's use_custom_op_collectives gives; vLLM found no platform here).
    The communicator vLLM picks without a platform (DeviceCommunicatorBase) reduces in
    place and returns its input, which the functional ``vllm.all_reduce`` must not do
    (Inductor then reuses the input's buffer under the result: plain Inductor's tokens
    went wrong); CUDA's communicators return a new tensor, and so does this one."""
    if _state:
        return _state
    import torch.distributed as dist
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    ctx = set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))
    ctx.__enter__()
    rank = dist.get_rank()
    ps.init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo")
    ps.initialize_model_parallel(2)
    tp = ps.get_tp_group()
    tp.use_custom_op_call = True
    in_place = tp.device_communicator.all_reduce
    tp.device_communicator.all_reduce = lambda x: in_place(x.clone())
    _state.update(ctx=ctx, rank=rank)
    return _state


def _piece(seed: int):
    """A decoder layer's boundaries and the logits end, of vLLM's own layers, as its
    models call them: the vocab-parallel embedding (its all-reduce) -> RMSNorm (the
    residual stream starts there), a row-parallel matmul -> all-reduce -> fused add +
    RMSNorm, twice (attention's and the MLP's outputs; the second norm the model's
    final one), the LM head -> gather -> argmax."""
    import torch
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)

    class Piece(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.embed = VocabParallelEmbedding(V, H)
            self.norms = torch.nn.ModuleList(RMSNorm(H, eps=EPS) for _ in range(3))
            self.rows = torch.nn.Parameter(torch.randn(2, H, H, generator=g) / H ** 0.5)
            self.lm_head = ParallelLMHead(V, H)
            self.lp = LogitsProcessor(V)
            idx = self.lm_head.shard_indices
            n = idx.org_vocab_end_index - idx.org_vocab_start_index
            full = torch.randn(V, H, generator=g)
            with torch.no_grad():
                self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=g))
                for norm in self.norms:
                    norm.weight.copy_(torch.rand(H, generator=g) + 0.5)
                self.lm_head.weight.fill_(9.0)  # padding rows: would win unmasked
                self.lm_head.weight[:n] = full[idx.org_vocab_start_index:
                                               idx.org_vocab_end_index]
            self.lm_head.quant_method.process_weights_after_loading(self.lm_head)
            self.requires_grad_(False)  # inference: the graphs vLLM compiles

        def forward(self, ids):
            residual = self.embed(ids)
            h = self.norms[0](residual)
            for i in (1, 2):  # this rank's partial sums of a row-parallel layer
                partial = h @ self.rows[i - 1]
                h, residual = self.norms[i](tensor_model_parallel_all_reduce(partial),
                                            residual)
            return self.lp(self.lm_head, h).argmax(-1), h, residual

    return Piece()


def _ops(graph) -> dict[str, int]:
    """The graph's calls by op (an auto_functionalized node by the op it runs)."""
    import torch

    found: dict[str, int] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if n.target in (torch.ops.higher_order.auto_functionalized,
                        torch.ops.higher_order.auto_functionalized_v2):
            name = f"auto_functionalized({n.args[0]})"
        found[name] = found.get(name, 0) + 1
    return found


def _err(got, want) -> float:
    """The largest difference, relative to the largest magnitude."""
    return ((got - want).abs().max() / want.abs().max()).item()


def _graph_step(tokens: tuple[int, ...]) -> dict:
    import torch
    from torch._inductor import config as inductor_config

    import commfold
    from commfold.distributed.comm_log import record_collectives

    rank = _setup()["rank"]
    torch._dynamo.reset()
    piece = _piece(seed=3)
    graphs: dict[str, dict] = {}

    def grab(name):
        def post(graph):
            graphs[name] = _ops(graph)
        return post

    plain = torch.compile(piece, backend="inductor")
    ours = torch.compile(piece, backend=commfold.backend(passes=(FUSED, PICK), strict=True,
                                                         fuse_cost_rule=False))
    commfold.clear_reports()
    out: dict = {"rank": rank, "runs": []}
    for t in tokens:
        torch.set_grad_enabled(False)
        ids = torch.randint(0, V, (t,), generator=torch.Generator().manual_seed(t))
        ids[0] = V - 1  # rank 1's last real row, next to the padding
        with inductor_config.patch(post_grad_custom_post_pass=grab(f"before{t}"),
                                   fx_graph_cache=False):
            want = plain(ids)
        with inductor_config.patch(post_grad_custom_post_pass=grab(f"after{t}"),
                                   fx_graph_cache=False), record_collectives() as log:
            got = ours(ids)
        eager = piece(ids)
        out["runs"].append(dict(
            tokens=t, picks=got[0].tolist(), plain=want[0].tolist(), eager=eager[0].tolist(),
            same_tokens=torch.equal(got[0], want[0]),
            same_as_eager=torch.equal(got[0], eager[0]),
            norm_err=_err(got[1], want[1]), residual_err=_err(got[2], want[2]),
            calls={k: log.calls(k) for k in ("all_reduce", "all_gather")},
            gathered=log.bytes("all_gather"),
            padding_picked=bool((got[0] >= V).any())))
    reports = commfold.reports()
    out["rewrites"] = [{p: r.count(p) for p in (FUSED, PICK)} for r in reports]
    out["summaries"] = [r.summary() for r in reports]
    out["before"] = graphs.get(f"before{tokens[0]}", {})
    out["after"] = graphs.get(f"after{tokens[0]}", {})
    return out


@pytest.fixture(scope="module")
def ranks():
    from commfold.distributed.ranks import RankPool

    with RankPool(2, timeout=900) as pool:
        yield pool


def test_graph_passes_on_vllm_release_pieces(ranks, record_property):
    r0, r1 = ranks.run(_graph_step, (7, 5))
    before, after = r0["before"], r0["after"]
    # what the passes were handed: the release's own spellings
    assert before.get("vllm.all_reduce.default") == NORMS, before
    assert before.get("vllm.all_gather.default") == 1, before
    assert before.get("vllm_ir.rms_norm.default") == 1, before
    assert before.get("auto_functionalized(vllm_ir.fused_add_rms_norm.maybe_inplace)") \
        == 2, before
    # what they made of it: both norm sites fused, the pick local, no gather left
    fused = "auto_functionalized(commfold.allreduce_rmsnorm.default)"
    assert after.get(fused) == NORMS, "\n".join(r0["summaries"] + [str(after)])
    assert after.get("commfold.local_argmax.default") == 1, after
    assert not any("all_gather" in op or "vllm_ir" in op for op in after), after
    for r in (r0, r1):
        assert r["rewrites"] and all(c == {FUSED: NORMS, PICK: 1} for c in r["rewrites"]), r
        for run in r["runs"]:
            assert run["same_tokens"] and run["same_as_eager"], str(run)
            assert run["norm_err"] <= 1e-5 and run["residual_err"] <= 1e-5, run
            assert run["calls"] == {"all_reduce": 3, "all_gather": 1}, run  # the pairs'
            assert run["gathered"] <= 32 * run["tokens"], run  # not the vocab's 4 KiB a row
            assert not run["padding_picked"], run
    assert [run["picks"] for run in r0["runs"]] == [run["picks"] for run in r1["runs"]]
    record_property("graph", json.dumps(dict(
        sites=[dict(site="all-reduce + RMSNorm", by=FUSED, matched=r0["rewrites"][0][FUSED],
                    of=NORMS),
               dict(site="vocab gather + argmax", by=PICK, matched=r0["rewrites"][0][PICK],
                    of=1)],
        graphs=len(r0["rewrites"]), tokens=[run["tokens"] for run in r0["runs"]],
        numerics="tokens equal to the unrewritten program's and eager vLLM's; normed "
                 "output and residual within 1e-5 (f32)",
        spellings=sorted(op for op in before if op.startswith(("vllm", "auto_func"))),
        not_run="vLLM's CUDA kernels (vllm._C does not load on CPU): its vllm.ir ops ran "
                "their native implementation; vLLM's own compile pipeline (VllmBackend, its "
                "IR lowering) not used: plain torch.compile with commfold's backend",
        note="vllm.all_reduce over the platform-less DeviceCommunicatorBase reduces in "
             "place, against the op's functional contract: made out of place as CUDA's")))
