"""Benchmarks: the paper's workloads, runners against numpy/PyTorch, reports."""
