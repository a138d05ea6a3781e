"""The CUDA delegation of commfold::allreduce_rmsnorm to FlashInfer, run on gloo CPU
ranks against a stand-in of flashinfer.comm (harness/flashinfer_standin.py): which
calls go to FlashInfer, what they hand over (workspace per group/hidden/dtype and
its size, rows, residual, gamma, eps, Gemma's bias), results equal to the composite
path, and every ineligible call (or a failed workspace) taking the composite path.
No GPU is involved: this checks commfold's side of the contract only."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from harness import flashinfer_standin
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DELEGATED = [  # dtype, shape, residual, weight, offset
    (F32, (5, 64), True, True, 0.0),
    (BF16, (3, 96), True, True, 0.0),
    (F16, (4, 64), False, True, 0.0),
    (F32, (2, 64), True, False, 0.0),
    (BF16, (3, 64), True, True, 1.0),
    (F32, (2, 3, 64), True, True, 0.0),
]
# (why, dtype, shape, weight dtype, offset_in_weight_dtype, round_before_weight, out dtype, env)
NOT_DELEGATED = [
    ("out dtype", BF16, (3, 64), BF16, False, False, F32, {}),
    ("f32 weight", BF16, (3, 64), F32, False, False, BF16, {}),
    ("offset in weight dtype", BF16, (3, 64), BF16, True, False, BF16, {}),
    ("cast before weight", BF16, (3, 64), BF16, False, True, BF16, {}),
    ("too large", F32, (8, 64), F32, False, False, F32, {"COMMFOLD_FLASHINFER_MAX_BYTES": "1024"}),
    ("switched off", F32, (3, 64), F32, False, False, F32, {"COMMFOLD_FLASHINFER": "0"}),
]


def _inputs(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    w = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(seed + 1)) + 0.5)
    return x, r, w


def _call(fn, widened: bool, x, r, w, offset, off_in_w=False, round_bw=False, out_dtype=None):
    """(normed, new residual) from the op's implementation, with the delegation's device
    list widened to CPU (as on CUDA) or not (the composite / C++ kernel path). The op
    writes the new residual over its input: it gets a copy of x."""
    from commfold.ops.allreduce_rmsnorm import allreduce_rmsnorm, pack_flags

    fn.DEVICE_TYPES = ("cuda", "cpu") if widened else ("cuda",)
    flags = pack_flags(offset_in_weight_dtype=off_in_w, round_before_weight=round_bw,
                       out_f32=(out_dtype or x.dtype) == torch.float32)
    try:
        h = x.clone()
        out = allreduce_rmsnorm(h, r, w, 1e-6, offset, flags,
                                "c10d:" + dist.group.WORLD.group_name)
        return out, h
    finally:
        fn.DEVICE_TYPES = ("cuda",)


def _diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def delegation_on_rank():
    from commfold.ops import flashinfer_norm as fn

    rec = flashinfer_standin.install()
    try:
        rows = []
        for i, (dtype, shape, res, weight, offset) in enumerate(DELEGATED):
            x, r, w = _inputs(dtype, shape, i)
            r, w = (r if res else None), (w.to(dtype) if weight else None)
            before = len(rec.calls)
            out, h = _call(fn, True, x, r, w, offset)
            ref_out, ref_h = _call(fn, False, x, r, w, offset)
            rows.append(dict(calls=len(rec.calls) - before, call=rec.calls[-1],
                             shapes=(out.shape, h.shape), dtype=(out.dtype, h.dtype),
                             d_out=_diff(out, ref_out), d_h=_diff(h, ref_h),
                             scale=float(ref_out.double().abs().max())))
        ws = [dict(w.args, group=w.args["group"] is dist.group.WORLD) for w in rec.workspaces]
        return rows, ws
    finally:
        flashinfer_standin.uninstall()


def fallbacks_on_rank():
    from commfold.ops import flashinfer_norm as fn

    rec = flashinfer_standin.install()
    out = []
    try:
        for i, case in enumerate(NOT_DELEGATED):
            why, dtype, shape, wdtype, off_in_w, round_bw, odt, env = case
            x, r, w = _inputs(dtype, shape, 100 + i)
            w = w.to(wdtype)
            offset = 1.0 if off_in_w else 0.0
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                fn.DEVICE_TYPES = ("cuda", "cpu")
                reason = fn.why_not(x, w, offset, off_in_w, round_bw, odt, _comm())
                got = _call(fn, True, x, r, w, offset, off_in_w, round_bw, odt)
                ref = _call(fn, False, x, r, w, offset, off_in_w, round_bw, odt)
            finally:
                fn.DEVICE_TYPES = ("cuda",)
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k)
                    else:
                        os.environ[k] = v
            out.append(dict(why=why, reason=reason,
                            equal=all(torch.equal(a, b) for a, b in zip(got, ref))))
        return out, len(rec.calls), rec.attempts
    finally:
        flashinfer_standin.uninstall()


def failed_workspace_on_rank():
    from commfold.ops import flashinfer_norm as fn

    rec = flashinfer_standin.install(fail_workspace=True)
    try:
        equal = []
        for i in range(2):
            x, r, w = _inputs(F32, (3, 64), 200 + i)
            got, ref = _call(fn, True, x, r, w, 0.0), _call(fn, False, x, r, w, 0.0)
            equal.append(all(torch.equal(a, b) for a, b in zip(got, ref)))
        return equal, rec.attempts, len(rec.calls)
    finally:
        flashinfer_standin.uninstall()


def not_installed_on_rank():
    import sys

    from commfold.ops import flashinfer_norm as fn

    flashinfer_standin.uninstall()
    sys.modules["flashinfer"] = None  # import fails, as without the package
    try:
        fn.DEVICE_TYPES = ("cuda", "cpu")
        x = torch.randn(3, 64)
        return fn.why_not(x, None, 0.0, False, False, x.dtype, _comm())
    finally:
        fn.DEVICE_TYPES = ("cuda",)
        flashinfer_standin.uninstall()


def scaled_on_rank():
    """The scaled overload's math on a FlashInfer device: never delegated (FlashInfer's
    fusion has no scale), bit-equal to the composite path."""
    from commfold.ops import flashinfer_norm as fn
    from commfold.ops.allreduce_rmsnorm import allreduce_rmsnorm, pack_flags

    rec = flashinfer_standin.install()
    out = []
    try:
        for i, (dtype, scale, divides) in enumerate([(F32, 0.22, False), (BF16, -3.0, True)]):
            x, r, w = _inputs(dtype, (3, 64), 300 + i)
            got = []
            for widened in (True, False):
                fn.DEVICE_TYPES = ("cuda", "cpu") if widened else ("cuda",)
                try:
                    h = x.clone()
                    got.append((allreduce_rmsnorm(h, r, w.to(dtype), 1e-6, 0.0,
                                                  pack_flags(scale_divides=divides), _comm().spec,
                                                  scale), h))
                finally:
                    fn.DEVICE_TYPES = ("cuda",)
            out.append(all(torch.equal(a, b) for a, b in zip(*got)))
        fn.DEVICE_TYPES = ("cuda", "cpu")
        try:
            reason = fn.why_not(x, w.to(x.dtype), 0.0, False, False, x.dtype, _comm(), True)
        finally:
            fn.DEVICE_TYPES = ("cuda",)
        return out, reason, len(rec.calls)
    finally:
        flashinfer_standin.uninstall()


def _comm():
    from commfold.distributed.collectives import communicator

    return communicator("c10d:" + dist.group.WORLD.group_name)


def test_eligible_calls_go_to_flashinfer_with_the_right_arguments(ranks):
    world = ranks.world_size
    for rank, (rows, ws) in enumerate(ranks.run(delegation_on_rank)):
        for (dtype, shape, _res, _weight, offset), row in zip(DELEGATED, rows):
            assert row["calls"] == 1
            tokens = shape[0] * (shape[1] if len(shape) == 3 else 1)
            assert row["call"] == dict(tokens=tokens, hidden=shape[-1], dtype=dtype, eps=1e-6,
                                       weight_bias=offset, fp32_acc=True)
            assert row["shapes"] == (torch.Size(shape),) * 2 and row["dtype"] == (dtype, dtype)
            # same math as the composite path; low precision: the stand-in reduces in
            # f32 (fp32_acc), the composite path in the input dtype
            tol = 1e-5 if dtype == F32 else 3e-2
            assert row["d_out"] <= tol * max(1.0, row["scale"]), (dtype, shape, row)
            assert row["d_h"] <= tol * 4 * world, (dtype, shape, row)
        # one workspace per (hidden, dtype), sized by the byte limit, on this group
        keys = [(w["hidden_dim"], w["dtype"]) for w in ws]
        assert keys == [(64, F32), (96, BF16), (64, F16), (64, BF16)]
        for w in ws:
            elem = torch.empty((), dtype=w["dtype"]).element_size()
            assert w["max_token_num"] == 2 * 2**20 // (w["hidden_dim"] * elem)
            assert ((w["backend"], w["world_size"], w["rank"], w["group"])
                    == ("trtllm", world, rank, True))


def test_ineligible_calls_take_the_composite_path_unchanged(ranks2):
    for out, calls, attempts in ranks2.run(fallbacks_on_rank):
        assert calls == 0 and attempts == 0
        for row in out:
            assert row["reason"], row  # each says why
            assert row["equal"], row  # bit-equal to the composite path


def test_a_scaled_residual_is_not_delegated(ranks2):
    for equal, reason, calls in ranks2.run(scaled_on_rank):
        assert equal == [True, True] and calls == 0
        assert reason == "scaled residual: FlashInfer fusion has no scale"


def test_failed_workspace_falls_back_once_and_is_not_retried(ranks2):
    for equal, attempts, calls in ranks2.run(failed_workspace_on_rank):
        assert equal == [True, True]
        assert attempts == 1 and calls == 0


def test_missing_flashinfer_is_a_reason_not_an_error(ranks2):
    for reason in ranks2.run(not_installed_on_rank):
        assert reason and "not installed" in reason


def test_byte_limit_env_then_vllm_table_then_default(monkeypatch):
    from commfold.ops import flashinfer_norm as fn

    monkeypatch.delenv("COMMFOLD_FLASHINFER_MAX_BYTES", raising=False)
    assert fn.max_bytes(2) == fn.DEFAULT_MAX_BYTES  # no GPU: vLLM's table has no entry
    monkeypatch.setattr(fn, "_vllm_table", lambda world: {2: 64 * 2**20}.get(world))
    assert (fn.max_bytes(2), fn.max_bytes(4)) == (64 * 2**20, fn.DEFAULT_MAX_BYTES)
    monkeypatch.setenv("COMMFOLD_FLASHINFER_MAX_BYTES", "4096")
    assert fn.max_bytes(2) == 4096
