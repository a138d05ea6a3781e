"""commfold inside vLLM: the plugin and the graph pass vLLM runs (``plugin``), each
runtime hook per model runner (``target_pick`` for V1, ``target_pick_v2`` for Model
Runner V2, ``draft`` for both runners' drafters, ``step_log``), the one decision both
runners' picks take (``decision``), the head their picks read (``logits_head``),
which runner and vLLM will run and each hook's one line (``runtime``,
``hook_points``, ``doctor``), and the drafter's compiled pick (``top_tokens``).

The only package of commfold that imports vLLM, and only when a module here is used:
importing ``commfold`` or this package imports no vLLM.
"""
