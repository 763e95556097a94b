"""Benchmarks, each run from the repository root as `python -m benchmarks.<name>` (`make bench`
runs them all); they import the installed fxpipe and `examples`, and share helpers."""
