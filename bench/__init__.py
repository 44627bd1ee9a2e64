"""Benchmarks: one script per hot path, `make bench` runs them all (see docs/BENCHMARKS.md).

Never part of the pass/fail test suite: numbers on a shared CPU box are noisy.
"""
