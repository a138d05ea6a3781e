"""The rewrites, one module each. PASSES maps a Config pass name to its run(ctx)."""
from . import (fuse_allreduce_rmsnorm, local_argmax, local_softmax_stats, local_topk,
               replicate_vocab_parallel)

PASSES = {
    "fuse_allreduce_rmsnorm": fuse_allreduce_rmsnorm.run,
    "replicate_vocab_parallel": replicate_vocab_parallel.run,
    "local_softmax_stats": local_softmax_stats.run,
    "local_topk": local_topk.run,
    "local_argmax": local_argmax.run,
}
