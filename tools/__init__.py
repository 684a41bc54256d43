"""Benchmark and table-building commands, run as `python -m tools.NAME` from the repository root; not installed."""
