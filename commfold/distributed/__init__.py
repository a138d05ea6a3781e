"""The distributed runtime: which group a fused op talks to (``collectives``), the
collectives a process ran (``comm_log``), N gloo ranks on one machine for tests,
benchmarks and ``commfold diff`` (``ranks``), and ranks of one machine lowering a
shared graph once (``compile_once``)."""
