"""The rows of a step whose top-k / top-p cut the bounds leave in doubt, made whole and
cut by vLLM's own kernel: exact where bounds are not.

commfold.shard.bounds bounds V2's cut from one small exchange; a row whose
tokens between its ``drop`` and ``keep`` matter (the draw could pick one, or the
verification's probabilities depend on them) used to give the whole step to V2. Here
only those rows are made whole: one all-gather of their processed float32 columns
([d, shard] per rank, the rows V2 passes ``apply_top_k_top_p``) builds them as V2
holds them ([d, vocab], padding columns cut), and vLLM's ``apply_top_k_top_p`` - the
function V2 calls, with the step's arguments as V2's ``get_top_k_top_p`` gives them
(``has_topp_only_rows`` from vLLM 0.33) - cuts them. Every rank runs it on the same
values and reads its own columns.

Why a subset of rows is cut as in V2's whole batch (sources pinned in sampled_pick):

- ``_topk_topp_kernel`` (the monolithic kernel: CPU, XPU, CUDA batches over
  ``_SPLIT_MAX_BATCH``, CUDA rows with an active top-k) loops over rows; a row reads
  its own logits, k and p and a scratch row of its program, which it writes before
  reading, so its cut depends on nothing but the row and the launch's constants
  (vocab, tile, TOPK_ENABLED, TOPP_ENABLED, SPLIT_COVERS_PONLY). The batch size only
  bounds the loop (Triton's specialization of it changes no arithmetic); the row
  stride is V2's (``vocab``: V2's float32 copy is contiguous).
- The constants are V2's: k and p are None exactly where V2's are (the step's
  requests decide), ``has_topp_only_rows`` is the step's, and on CUDA-like devices,
  where the batch size picks the path (``_SPLIT_MAX_BATCH``: the split top-p pipeline
  and SPLIT_COVERS_PONLY), the rows are padded with no-op rows (k = vocab, p = 1) to
  over ``_SPLIT_MAX_BATCH`` whenever the step has more: the subset takes the
  monolithic path as the step does. A step of at most ``_SPLIT_MAX_BATCH`` rows on
  CUDA reaches here only without top-p-only rows (commfold.vllm.target.decision refuses the
  split kernels' steps), so the split pipeline masks nothing in either batch.
- Without Triton (``apply_top_k_top_p_pytorch``: a sort whose order of ties may
  depend on the batch) nothing is made whole: the step keeps V2's path.

A step whose doubtful rows would cost more than half the bytes of vLLM's own gather
(float32 rows against its raw ones: a quarter of a bfloat16 step's rows) is given
back as before, the count in the reason: the step then sends well under what vLLM's
gather would, its other exchanges included. The gather of the rows and that rule are
commfold.shard.edges'; what reads vLLM's kernel and platform is here.
"""
from __future__ import annotations

import torch

from commfold.shard import edges
from commfold.vllm.compat import releases

NOTE_KEY = "top_k_top_p_whole"  # the step log's entry: how many rows were made whole


def note(rows: int) -> str:
    """The step log's line for a step with `rows` rows made whole."""
    return f"{rows} rows made whole for vLLM's top-k / top-p kernel"


def refusal(doubtful: int, rows: int, itemsize: int) -> str | None:
    """Why `doubtful` rows of a step of `rows` logits rows (raw logits of `itemsize`
    bytes: vLLM's gather sends rows * shard * itemsize per rank) are not made whole."""
    from vllm.v1.sample.ops import topk_topp_sampler

    if not topk_topp_sampler.HAS_TRITON:  # what apply_top_k_top_p branches on
        return "top-k / top-p: a token at the cut's edge, vLLM's sort-based cut"
    return edges.over_budget(doubtful, rows, itemsize)


def cut(rows: torch.Tensor, which: torch.Tensor, states, input_batch, batch: int,
        caller: str = "sampler") -> torch.Tensor:
    """vLLM's apply_top_k_top_p on the whole rows `rows` [d, vocab] (float32) - the
    step's rows `which` of `batch` - with their top_k / top_p as V2 passes them for the
    step (``states.get_top_k_top_p``); what V2's cut holds for those rows. caller: the
    V2 module whose import of the kernel V2 calls ("sampler": Sampler._sample_random;
    "states": SamplingStates.apply_top_k_top_p, V2's verification)."""
    import importlib

    module = importlib.import_module(f"vllm.v1.worker.gpu.sample.{caller}")
    vocab = rows.shape[1]
    get = states.get_top_k_top_p
    takes_vocab = releases.here().at_least("0.33.0")  # 0.33 added the vocab argument
    got = get(input_batch.expanded_idx_mapping, input_batch.idx_mapping_np,
              *((vocab,) if takes_vocab else ()))
    top_k, top_p = got[0], got[1]
    extra = {"has_topp_only_rows": got[2]} if len(got) > 2 else {}
    d = rows.shape[0]
    runs = kernel_rows(d, batch, rows.device)
    if runs > d:  # no-op rows: the subset takes the whole batch's path
        rows = torch.cat([rows, rows.new_zeros(runs - d, vocab)])
    k = None if top_k is None else _padded(top_k[which], runs, vocab)
    p = None if top_p is None else _padded(top_p[which], runs, 1.0)
    return module.apply_top_k_top_p(rows, k, p, **extra)[:d]


def _padded(x: torch.Tensor, n: int, value) -> torch.Tensor:
    return torch.cat([x, x.new_full((n - x.shape[0],), value)]) if n > x.shape[0] else x


def kernel_rows(doubtful: int, batch: int, device: torch.device) -> int:
    """How many rows to run the kernel on for `doubtful` rows of a batch of `batch`:
    over _SPLIT_MAX_BATCH where the batch is and the batch size picks the path (CUDA-
    like platforms: the split top-p pipeline, SPLIT_COVERS_PONLY)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops import topk_topp_triton

    split = getattr(topk_topp_triton, "_SPLIT_MAX_BATCH", 64)
    sized = device.type == "cuda" or bool(current_platform.is_cuda_alike())
    return split + 1 if sized and batch > split >= doubtful else doubtful
