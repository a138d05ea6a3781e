"""Programs that read softmax statistics of vocab-sharded logits, one per gather
spelling, run on every rank by tests/test_local_softmax_stats.py. Each takes this
rank's logits shard [rows, Vs] (and chosen token ids [rows, k]) and returns tensors."""
from __future__ import annotations

import torch
import torch.distributed as dist

from commfold.cli.demo_model import gather_last_dim
from harness import argmax_programs
from harness.argmax_programs import setup_mesh  # noqa: F401  (re-exported: DTensor programs need the mesh)


def _gather_funcol(shard):
    return gather_last_dim(shard, dist.group.WORLD)


def _gather_inplace(shard):
    w = dist.get_world_size()
    out = torch.empty(w * shard.shape[0], shard.shape[1], dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard)
    return out.view(w, shard.shape[0], shard.shape[1]).movedim(0, 1).reshape(shard.shape[0], -1)


def _gather_dtensor(shard):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(shard, argmax_programs._MESH, [Shard(1)],
                              run_check=False).full_tensor()


def logprob_at(shard, vocab, idx):
    """Logprobs of chosen tokens (e.g. a sampled or a reference token)."""
    x = _gather_funcol(shard)[:, :vocab]
    return torch.log_softmax(x.float(), -1).gather(-1, idx)


def greedy_logprob(shard, vocab, idx):
    """The greedy token and its logprob (vLLM's logprobs=1 greedy path)."""
    x = _gather_inplace(shard)[:, :vocab]
    tok = x.argmax(-1)
    lp = torch.log_softmax(x.float(), -1)
    return tok, lp.gather(-1, tok[:, None])


def logsumexp_temp(shard, vocab, idx):
    """The normalizer of temperature-scaled logits, in the logits' dtype."""
    x = _gather_dtensor(shard)[:, :vocab]
    return torch.logsumexp(x / 0.7, -1)


def top_prob(shard, vocab, idx):
    """Confidence of the top token: softmax(-1).max(-1)."""
    x = _gather_funcol(shard)[:, :vocab]
    v, i = torch.softmax(x.float(), -1).max(-1)
    return v, i


PROGRAMS = {"logprob_at": logprob_at, "greedy_logprob": greedy_logprob,
            "logsumexp_temp": logsumexp_temp, "top_prob": top_prob}
