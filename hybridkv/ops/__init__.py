"""Kernels as plain functions over tensors, each beside a slow readable twin in `naive.py`."""
