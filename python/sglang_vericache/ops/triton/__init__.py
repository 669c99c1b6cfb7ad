"""Triton kernels (shipped inside the package). Import lazily: Triton is optional on CPU."""
