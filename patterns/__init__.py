"""Recognizers: turn FX nodes into typed, vocabulary-free matches.

Only this package knows how ops are spelled (c10d functional collectives, vLLM custom
ops, aten decompositions). A recognizer returns a match object, or a ``Miss`` whose
reason a pass records as a near-miss.
"""
from .common import Miss  # noqa: F401
