"""Runnable examples: `python -m examples.NAME` from the checkout root."""
