"""Scaffolding for tests, benchmarks and examples (not installed): tiny models written
offline, vLLM tensor-parallel set-up, timing helpers. Importable from the checkout root."""
