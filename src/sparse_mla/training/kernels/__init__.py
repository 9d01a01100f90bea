"""Triton kernels of the training path (imported on first launch, never by ``import sparse_mla``)."""
