"""Benchmarks of sparse_mla (run as modules from the repository root: ``python -m benchmarks.decode``)."""
