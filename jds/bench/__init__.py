"""Benchmark helpers and benchmarks, each runnable as ``python -m jds.bench.<name>``.

Nothing in the library imports this package: it sits above the runner and the model in the import graph.
"""
