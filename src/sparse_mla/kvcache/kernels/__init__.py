"""The cache writes' Triton kernels (imported on first launch): :mod:`.store` (fused quantise-and-store)
and :mod:`.index_convert` (positions → cache indices)."""
