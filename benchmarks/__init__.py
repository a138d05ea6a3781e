"""commfold's performance suite: ``python -m benchmarks`` (or ``commfold bench``)
measures commfold against plain Inductor side by side and writes results.json,
results.md and PNG plots. Each bench_*.py is also a script of its own."""
