"""What commfold knows of vLLM's releases: which it claims, the pinned sources, the
hook points each hook relies on, which vLLM and runner this process runs, and the
registry of hooks."""
