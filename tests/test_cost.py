"""The cost table (commfold.cost): every number names a file of this checkout that
holds its measurement, every rule has a check, the most specific entry wins, the
Config defaults are the table's, and no pass or pattern holds a measured figure."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import commfold
from commfold import cost

ROOT = Path(__file__).resolve().parent.parent


def _sources() -> list[str]:
    return [lim.measured_in for lim in cost.TABLE.values()] + [
        v.measured_in for v in vars(cost).values() if isinstance(v, cost.Measured)]


@pytest.mark.parametrize("where", _sources())
def test_every_number_names_where_it_was_measured(where):
    if where.startswith("not measured"):
        return
    path = ROOT / where.split(",")[0].split(" ")[0]
    assert path.is_file(), where
    text = path.read_text()
    for section in re.findall(r'"([^"]+)"', where):
        assert f"## {section}" in text, (where, section)
    for figure in re.findall(r"`([^`]+)`", where):
        assert f"`{figure}`" in text, (where, figure)


def test_every_rule_has_a_check():
    assert {k.rule for k in cost.TABLE} <= set(cost.CHECKS)


def test_most_specific_entry_wins_and_unlisted_sites_are_not_slower():
    shm32 = cost.Site(cost.FUSE, "cpu", cost.SHM, torch.float32, nbytes=1024)
    assert cost.limit_for(shm32).least == 256 << 10 and cost.why_slower(shm32)
    assert cost.why_slower(cost.Site(cost.FUSE, "cpu", cost.SHM, torch.float32,
                                     nbytes=256 << 10)) is None
    assert cost.why_slower(cost.Site(cost.FUSE, "cpu", cost.SHM, torch.float64)) is None
    assert cost.why_slower(cost.Site(cost.FUSE, "cpu", cost.GLOO, torch.float32)) is None
    assert cost.why_slower(cost.Site(cost.FUSE, "cpu", cost.VLLM, torch.bfloat16)) is None
    assert cost.why_slower(cost.Site(cost.FUSE, "cuda", cost.FLASHINFER, torch.bfloat16)) \
        is None
    assert "composite path" in cost.why_slower(
        cost.Site(cost.FUSE, "cuda", cost.COMPOSITE, torch.bfloat16))


def test_config_defaults_come_from_the_table():
    default = commfold.Config()
    assert default.replicate_max_bytes == cost.DEFAULT_REPLICATE_MAX_BYTES.value
    assert default.two_shot_min_bytes == cost.DEFAULT_TWO_SHOT_MIN_BYTES.value
    limit, what = cost.head_limit(default, "cpu")
    assert limit == cost.limit_for(cost.Site(cost.REPLICATE_HEAD, "cpu")).most
    assert "measured cpu head limit" in what
    assert cost.head_limit(default, "cuda") == (default.replicate_max_bytes,
                                                "replicate_max_bytes")


# a ratio (0.93x), a share (28%), a timing (5.8 us, 1.3 ms), a size (9.3 MiB: the
# table's), a machine named for its figures
FIGURE = re.compile(r"\b\d+(\.\d+)?x\b|\d%|\b\d+(\.\d+)? ?(us|µs|ms|KiB|MiB|GiB)\b"
                    r"|first machine|H200")


def test_no_measured_figure_in_passes_or_patterns():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for folder in ("passes", "patterns") for p in sorted((ROOT / folder).glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if FIGURE.search(line)]
    assert found == []


def test_batch_sharded_pick_weighs_bytes_moved():
    """V2's batch-sharded sampling stays when its all-to-all moves fewer bytes than the
    pick's pairs (commfold.vllm.target.target_pick_v2 asks this per step)."""
    def site(rows, vocab, world, dtype):
        return cost.Site(cost.BATCH_SHARDED_PICK, dtype=dtype, rows=rows, vocab=vocab,
                         world=world)

    assert cost.why_slower(site(4, 100, 2, torch.bfloat16)) is None  # 64 B < 200 B
    assert cost.why_slower(site(8, 8, 2, torch.float32)) == \
        "batch-sharded sampling moves less (64 B < 128 B)"


def test_the_pick_rule_weighs_the_gathered_bytes():
    """vLLM's token picks: one exchange (greedy, verify, the drafter's pick) is never
    slower on the CPU communicators nor, by the GPU estimate, on CUDA; two (top-k
    logprobs) are below a few rows' logits, on CUDA below the estimate's bytes (28 rows
    of V=151936 at TP=2 in 16 bits)."""
    bf16 = torch.bfloat16

    def site(rule, device, comm, rows, vocab=151936):
        return cost.pick_site(rule, device, comm, bf16, rows, vocab, 2)

    for comm, local_from in ((cost.SHM, 8), (cost.GLOO, 4)):
        assert cost.why_slower(site(cost.LOCAL_PICK, "cpu", comm, 1)) is None
        assert cost.why_slower(site(cost.LOCAL_LOGPROBS, "cpu", comm, local_from // 2))
        assert cost.why_slower(site(cost.LOCAL_LOGPROBS, "cpu", comm, local_from)) is None
    assert site(cost.LOCAL_PICK, "cpu", cost.SHM, 3, vocab=1001).nbytes == 3 * 501 * 2
    assert cost.why_slower(site(cost.LOCAL_PICK, "cuda", cost.VLLM, 1)) is None
    why = cost.why_slower(site(cost.LOCAL_LOGPROBS, "cuda", cost.VLLM, 27))
    assert why and "27 row(s)" in why and "GPU estimate" in why
    assert cost.why_slower(site(cost.LOCAL_LOGPROBS, "cuda", cost.VLLM, 28)) is None


def test_the_pick_rule_per_engine_step_and_its_switch(monkeypatch):
    """commfold.vllm.target.pick_cost asks the table with a step's rows and the TP group's
    communicator spec (vLLM's custom ops on CUDA here); COMMFOLD_PICK_COST_RULE=0
    takes every step."""
    from commfold.vllm.target import pick_cost

    args = (torch.bfloat16, "cuda", "vllm:tp:0", 151936, 2)
    assert "cost rule: 16 row(s)" in pick_cost.slower("logprobs", 16, *args)
    assert pick_cost.slower("draft", 1, *args) is None
    assert pick_cost.slower("logprobs", 28, *args) is None
    # a sampled step's three exchanges: vLLM's below 64 rows of V=151936 at TP=2
    assert "cost rule: 63 row(s)" in pick_cost.slower("sample", 63, *args)
    assert pick_cost.slower("sample", 64, *args) is None
    assert pick_cost.slower("sample", 1, torch.bfloat16, "cpu", "vllm_shm:0", 151936, 2) \
        is None
    assert pick_cost.slower("logprobs", 1, torch.bfloat16, "cpu", "vllm_shm:0", 151936, 2)
    monkeypatch.setenv(pick_cost.ENV, "0")
    assert pick_cost.slower("logprobs", 16, *args) is None


def test_sampled_verification_is_left_where_it_sends_no_fewer_bytes(monkeypatch):
    """Verifying sampled requests from the shards borrows the columns of 8192-column
    blocks split across ranks (float32 where V2 processes the logits): a vocab whose
    blocks span most of a shard sends more than vLLM's gather, so the step stays
    vLLM's; real vocabularies keep it; COMMFOLD_PICK_COST_RULE=0 takes it."""
    from types import SimpleNamespace

    from commfold.vllm.target import pick_cost
    from commfold.shard import layout

    def head(vocab: int, world: int):
        shard = -(-vocab // 64) * 64 // world
        return SimpleNamespace(comm="vllm:tp:0", vocab=vocab, world=world, shard=shard)

    like = torch.zeros(64, 8, dtype=torch.bfloat16)
    mode = "verify_sampled"
    for vocab, world in ((128256, 2), (151936, 8), (32768, 4)):
        assert pick_cost.gate(mode, "ok", 64, like, head(vocab, world)) == (mode, "ok")
    for vocab, world in ((3000, 2), (20011, 4), (32000, 8)):
        got = pick_cost.gate(mode, "ok", 64, like, head(vocab, world))
        assert got == (None, layout.NO_SAVING), (vocab, world)
        # the rule's bound is the formula's: a row's bytes at their most against a gather
        h = head(vocab, world)
        most = layout.exchanged_bytes(1, 0, h.shard, vocab, world, 2, True, True, True)
        assert most >= h.shard * 2
    monkeypatch.setenv(pick_cost.ENV, "0")
    assert pick_cost.gate(mode, "ok", 64, like, head(3000, 2)) == (mode, "ok")


def test_the_dspark_block_rule_weighs_the_gather_per_exchange(monkeypatch):
    """DSpark's block: one exchange per position against one gather of the block's
    logits; below the measured bytes per exchange (2 KiB on shared memory, 64 KiB on
    gloo) vLLM's gather; the switch takes every block."""
    from commfold.vllm.target import pick_cost

    def why(comm, reqs, positions, vocab):
        return cost.why_slower(cost.dspark_site("cpu", comm, torch.bfloat16, reqs, positions,
                                                vocab, 2))

    site = cost.dspark_site("cpu", cost.GLOO, torch.bfloat16, 4, 3, 1001, 2)
    assert (site.nbytes, site.exchanges) == (4 * 3 * 501 * 2, 3)
    assert "3 exchanges" in why(cost.GLOO, 1, 3, 1000)
    assert why(cost.GLOO, 1, 3, 32000) and why(cost.GLOO, 4, 3, 32000) is None
    assert why(cost.GLOO, 1, 7, 151936) is None  # 151936 B per exchange
    assert why(cost.SHM, 1, 3, 1000) and why(cost.SHM, 4, 7, 1000) is None
    assert why(cost.SHM, 1, 7, 32000) is None
    args = (torch.bfloat16, "cpu", "vllm_shm:0", 1000, 2)
    assert "DSpark" in pick_cost.slower_block(1, 3, *args)
    monkeypatch.setenv(pick_cost.ENV, "0")
    assert pick_cost.slower_block(1, 3, *args) is None
