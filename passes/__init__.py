"""The rewrites, one module each. PASSES maps a Config pass name to its run(ctx)."""
from . import fuse_allreduce_rmsnorm, local_argmax, replicate_vocab_parallel

PASSES = {
    "fuse_allreduce_rmsnorm": fuse_allreduce_rmsnorm.run,
    "replicate_vocab_parallel": replicate_vocab_parallel.run,
    "local_argmax": local_argmax.run,
}
