"""The `commfold` torch.compile backend: Inductor with commfold's passes as the
post-grad custom pass (composed with any pass the user already set)."""
from __future__ import annotations

import logging

from torch._inductor import config as inductor_config

from commfold.config import Config
from commfold import report_cache
from commfold.manager import CommfoldPass
from commfold.report import publish


log = logging.getLogger("commfold")


def backend(**options):
    """A torch.compile backend with commfold's passes configured by ``options``
    (the fields of ``commfold.Config``), e.g.
    ``torch.compile(model, backend=commfold.backend(passes=["local_argmax"]))``."""
    config = options.pop("config", None) or Config(**options)

    def commfold_compile(gm, example_inputs, **kwargs):
        from torch._inductor.compile_fx import compile_fx

        user_pass = inductor_config.post_grad_custom_post_pass
        if isinstance(user_pass, CommfoldPass):  # already composed (nested use)
            user_pass = user_pass.then
        made: list = []
        key = None

        def keep(report):  # saved before Inductor writes its cache entry: no race
            made.append(report)
            if key is not None:
                report_cache.save(key, made, report_cache.locations(gm))

        pass_ = CommfoldPass(config, then=user_pass, on_report=keep)
        key = report_cache.graph_key(gm, example_inputs, pass_.uuid())
        with inductor_config.patch(post_grad_custom_post_pass=pass_):
            compiled = compile_fx(gm, example_inputs, **kwargs)
        if key is not None and not made:  # Inductor's cache served it: republish what
            served = report_cache.load(key, report_cache.locations(gm))  # the passes did
            for r in served:
                publish(r)
            if not served:
                log.info("commfold: Inductor's cache served a graph (%d nodes) whose report "
                         "this process never saved (its lowered form was compiled from "
                         "another Python graph): no report for it; "
                         "TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0 "
                         "recompile it", len(gm.graph.nodes))
        return compiled

    commfold_compile.config = config
    return commfold_compile


# The entry point named in pyproject (torch_dynamo_backends): backend="commfold".
commfold_backend = backend()
