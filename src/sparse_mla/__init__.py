"""sparse_mla: DeepSeek Sparse Attention MLA decode kernels in Triton with FlashMLA's API.

``import sparse_mla as flash_mla`` is a drop-in for FlashMLA 1.0's sparse FP8 decode.
"""
from .interface import FlashMLASchedMeta, flash_mla_with_kvcache, get_mla_metadata
from .kvcache import (
    MODEL1,
    V32,
    KVCacheLayout,
    abs_indices_to_kvcache_indices,
    dequantize_k_cache,
    get_layout,
    quantize_k_cache,
)

__version__ = "0.1.0"

__all__ = [
    "FlashMLASchedMeta",
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "KVCacheLayout",
    "V32",
    "MODEL1",
    "get_layout",
    "quantize_k_cache",
    "dequantize_k_cache",
    "abs_indices_to_kvcache_indices",
]
