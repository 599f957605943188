"""Benchmarks run on a GPU: `python -m tilegen.bench.attention`, `python -m tilegen.bench.tuning`."""
