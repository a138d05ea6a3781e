"""commfold's custom ops (namespace ``commfold``), each with a fake kernel so they
trace under FakeTensorMode and Inductor treats them as extern kernels."""
from . import allreduce_rmsnorm  # noqa: F401
from . import local_argmax  # noqa: F401
from . import local_topk  # noqa: F401
from . import replicate  # noqa: F401
from . import softmax_stats  # noqa: F401
