"""Benchmark suites; each measures its reference in the same run (see bench/contract.py)."""
