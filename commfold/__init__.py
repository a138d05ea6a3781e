"""commfold: torch.compile / Inductor passes that take tensor-parallel communication
out of LLM inference graphs, without touching model source.

    torch.compile(model, backend="commfold")
    torch.compile(model, backend=commfold.backend(passes=["local_argmax"]))
    torch._inductor.config.post_grad_custom_post_pass = commfold.CommfoldPass()

Importing commfold registers its custom ops (namespace ``commfold``); it never
imports vLLM.
"""
from commfold import checkout
from commfold import ops  # noqa: F401  (registers torch.ops.commfold.*)
from commfold.backend import backend
from commfold.config import ALL_PASSES, Config
from commfold.manager import CommfoldPass
from commfold.report import Comm, NearMiss, Report, Rewrite, clear_reports, last_report, reports
from commfold.vllm.plugin import vllm_pass  # vLLM resolves "commfold.vllm_pass" in this namespace

checkout.install()  # run from a checkout (PYTHONPATH=.): commfold.passes, .patterns beside it

__version__ = "0.1.0"

__all__ = [
    "ALL_PASSES", "Comm", "CommfoldPass", "Config", "NearMiss", "Report", "Rewrite",
    "backend", "clear_reports", "last_report", "reports", "vllm_pass",
]
