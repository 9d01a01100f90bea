"""Every PyTorch reference twin in one namespace (fp32, CPU or CUDA; the test oracles). Each twin
lives beside its kernel: the decode and combine twins in :mod:`sparse_mla.decode.reference`, the
cache-write and index-conversion twins in :mod:`sparse_mla.kvcache.reference`."""

from .decode.reference import (
    LOG2E,
    combine_reference,
    combine_weights,
    dense_decode_reference,
    gather_dense_kv,
    gather_kv,
    sparse_decode_reference,
    sparse_decode_split_reference,
)
from .kvcache.reference import abs_indices_to_kvcache_indices, quantize_and_store_kv_reference

__all__ = [
    "gather_kv",
    "sparse_decode_reference",
    "sparse_decode_split_reference",
    "gather_dense_kv",
    "dense_decode_reference",
    "combine_reference",
    "combine_weights",
    "LOG2E",
    "quantize_and_store_kv_reference",
    "abs_indices_to_kvcache_indices",
]
