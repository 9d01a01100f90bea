"""Triton kernels (one per file) with small launchers; PyTorch twins live in :mod:`sparse_mla.reference`."""
