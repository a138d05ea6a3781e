"""The rewrites, one module each. PASSES maps a Config pass name to its run(ctx)."""
from . import local_argmax

PASSES = {
    "local_argmax": local_argmax.run,
}
