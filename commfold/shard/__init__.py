"""Engine-independent math of picking tokens from vocab shards (no vLLM imported)."""
