"""commfold's custom ops (namespace ``commfold``), each with a fake kernel so they
trace under FakeTensorMode and Inductor treats them as extern kernels."""
from commfold.ops import allreduce_rmsnorm  # noqa: F401
from commfold.ops import local_argmax  # noqa: F401
from commfold.ops import local_topk  # noqa: F401
from commfold.ops import replicate  # noqa: F401
from commfold.ops import softmax_stats  # noqa: F401
