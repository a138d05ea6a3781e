"""The torch.compile backend, the Inductor custom-pass protocol, and the cache key."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
import torch.distributed as dist
from torch._inductor import config as inductor_config

import commfold
from commfold.distributed.comm_log import record_collectives

from harness.gathers import all_gather_last_dim


def test_backend_name_works_in_a_fresh_process():
    """backend="commfold" resolves through the torch_dynamo_backends entry point in a
    process that never imported commfold."""
    code = textwrap.dedent("""
        import sys, torch
        assert "commfold" not in sys.modules
        f = torch.compile(lambda x: torch.sin(x) + 1, backend="commfold")
        assert torch.allclose(f(torch.ones(3)), torch.sin(torch.ones(3)) + 1)
        import commfold
        print("REPORTS", len(commfold.reports()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REPORTS 1" in out.stdout


def test_user_post_grad_pass_still_runs():
    seen = []

    class UserPass:
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return "user-pass-v1"

    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=UserPass(), fx_graph_cache=False):
        out = torch.compile(lambda x: x.cos() * 2, backend="commfold")(torch.ones(4))
        assert isinstance(inductor_config.post_grad_custom_post_pass, UserPass)
    assert torch.allclose(out, torch.ones(4).cos() * 2)
    assert len(seen) == 1


def test_uuid_covers_config_and_composed_pass():
    base = commfold.CommfoldPass().uuid()
    assert base == commfold.CommfoldPass(commfold.Config()).uuid()
    assert base != commfold.CommfoldPass(commfold.Config(passes=())).uuid()
    assert base != commfold.CommfoldPass(commfold.Config(replicate_max_bytes=1)).uuid()

    class Keyed:
        def __call__(self, g): ...
        def uuid(self): return "k1"

    assert commfold.CommfoldPass(then=Keyed()).uuid() not in (None, base)
    assert commfold.CommfoldPass(then=lambda g: None).uuid() is None  # unkeyed: no caching


def test_config_rejects_unknown_pass_with_the_choices():
    with pytest.raises(ValueError, match="unknown pass name.*choose from"):
        commfold.Config(passes=("local_argmx",))


def greedy(x):
    return all_gather_last_dim(x).argmax(-1)


def cache_never_serves_another_config() -> list:
    """Same program compiled under two configs with Inductor's FX graph cache on: each
    gets its own compiled graph (the pass uuid is in the cache key)."""
    out = []
    x = torch.randn(5, 48) * (1 + dist.get_rank())
    with inductor_config.patch(fx_graph_cache=True):
        for cfg in ({}, {"passes": ()}, {}):
            torch._dynamo.reset()
            fn = torch.compile(greedy, backend=commfold.backend(**cfg))
            fn(x)
            with record_collectives() as log:
                y = fn(x)
            out.append((log.elements("all_gather"), commfold.last_report().count("local_argmax"),
                        torch.equal(y, greedy(x))))
    return out


def test_cache_never_serves_another_config(ranks2):
    for res in ranks2.run(cache_never_serves_another_config):
        assert res == [(5 * 2, 1, True), (5 * 48, 0, True), (5 * 2, 1, True)]


PROGRAM = """
from harness.gathers import all_gather_last_dim


def pick(x):
    return all_gather_last_dim(x).argmax(-1)
"""


def cached_report_names_the_moved_line(tmp: str) -> list:
    """Inductor's cache key ignores stack traces: the same program compiled again after
    lines were added above it is served from the cache, and its report must name the
    line where the pick is now, not where it was."""
    import importlib.util
    import pathlib

    out = []
    path = pathlib.Path(tmp) / f"user_program_{dist.get_rank()}.py"
    x = torch.randn(5, 48) * (1 + dist.get_rank())
    with inductor_config.patch(fx_graph_cache=True):
        for pad in ("", "# a comment\n\n\n"):
            path.write_text(pad + PROGRAM)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            torch._dynamo.reset()
            commfold.clear_reports()
            torch.compile(module.pick, backend="commfold")(x)
            report = commfold.last_report()
            lines = (pad + PROGRAM).splitlines()
            line = lines.index("    return all_gather_last_dim(x).argmax(-1)")
            out.append((report.from_cache, [r.location for r in report.rewrites],
                        f"{path.parent.name}/{path.name}:{line + 1} (pick)"))
    return out


def test_cached_report_names_the_moved_line(ranks2, tmp_path):
    for res in ranks2.run(cached_report_names_the_moved_line, str(tmp_path)):
        (hit0, where0, expect0), (hit1, where1, expect1) = res
        assert hit1 and where0 == [expect0] and where1 == [expect1] and expect0 != expect1


def test_many_token_picks_in_one_process_all_compile():
    """Dynamo stops compiling a code object after its recompile limit and runs it
    eagerly (a pick would gather again, silently): each pick built by
    commfold.vllm.spec_decode.top_tokens has a code object of its own, so a process holding more
    picks than the limit (drafters, test suites) compiles every one with commfold."""
    from commfold.report import clear_reports, reports
    from commfold.vllm.spec_decode.top_tokens import top_tokens_fn

    limit = torch._dynamo.config.recompile_limit
    clear_reports()
    for i in range(limit + 3):
        head = torch.nn.Linear(4, 7 + i)
        pick = top_tokens_fn(lambda h, head=head: head(h))
        x = torch.randn(3, 4)
        assert torch.equal(pick(x), head(x).argmax(-1))
    assert len(reports()) >= limit + 3  # one commfold compile per pick


def test_a_cache_hit_without_its_report_says_so(tmp_path, monkeypatch, caplog):
    """Inductor's cache serves a graph whose report was never saved here (its lowered
    form came from another Python graph; here: the saved report removed): no stale or
    invented report, one line saying so and how to recompile."""
    import logging
    import shutil

    from commfold import report_cache

    monkeypatch.setattr(report_cache, "_dir", lambda: tmp_path / "reports")

    nonce = float(uuid.uuid4().int % 10_000) + 0.5  # a graph no earlier run cached

    def f(x):
        return (x * nonce + 1).relu()

    x = torch.randn(4, 8)
    with inductor_config.patch(fx_graph_cache=True), caplog.at_level(logging.INFO, "commfold"):
        for attempt in range(2):
            torch._dynamo.reset()
            commfold.clear_reports()
            torch.compile(f, backend="commfold")(x)
            if attempt == 0:
                assert commfold.last_report() is not None
                assert (tmp_path / "reports").exists()
                shutil.rmtree(tmp_path / "reports")
    assert commfold.last_report() is None  # the second compile: served, nothing to replay
    assert any("whose report this process never saved" in r.getMessage()
               for r in caplog.records)


def test_a_report_is_keyed_by_torch_version(monkeypatch):
    """Cache dirs are shared across venvs: the same Python graph compiled by another
    torch may have been rewritten differently, so its saved report is not this one's."""
    from commfold import report_cache

    gm = torch.fx.symbolic_trace(lambda x: (x + 1).relu())
    x = torch.randn(2, 3)
    key = report_cache.graph_key(gm, [x], "uuid")
    assert report_cache.graph_key(gm, [x], "uuid") == key
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert report_cache.graph_key(gm, [x], "uuid") != key
