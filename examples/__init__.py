"""Runnable examples; `examples.zoo` is imported by the tests and benchmarks (from the repository
root, where pytest and `python -m` find it)."""
