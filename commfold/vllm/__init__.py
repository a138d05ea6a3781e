"""commfold inside vLLM, the only package of commfold that imports vLLM (and only when
a module here is used: importing ``commfold`` or this package imports no vLLM).

- ``plugin``, ``graph_passes``, ``groups``: the plugin vLLM loads, the graph pass it
  runs, the groups commfold's ops talk over;
- ``compat/``: the releases commfold claims, their pinned sources, the hook points,
  which vLLM and runner run here, the registry of hooks;
- ``target/``: the target model's token pick from the vocab shards;
- ``sample/``: Model Runner V2's sampled step drawn on one shard;
- ``spec_decode/``: drafters' picks, the draft cache, verification of drafts;
- ``observe/``: per-step collective logs and `commfold doctor`.

The math that needs no vLLM (layouts, bounds, payloads, first maximum across ranks)
lives in ``commfold.shard``.
"""
