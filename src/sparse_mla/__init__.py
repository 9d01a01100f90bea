"""sparse_mla: DeepSeek Sparse Attention MLA decode kernels in Triton with FlashMLA's API.

``import sparse_mla as flash_mla`` is a drop-in for FlashMLA 1.0's sparse FP8 decode.

Serving path (imported lazily, so that ``TRITON_INTERPRET`` can still be set after
``import sparse_mla``): ``quantize_and_store_kv`` (fused FP8 cache write) and
``abs_indices_to_kvcache_indices_triton`` (index conversion kernel); ``import sparse_mla.library``
registers the ``torch.ops.sparse_mla.*`` custom ops.
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
    "quantize_and_store_kv",
    "abs_indices_to_kvcache_indices_triton",
]

_LAZY = {
    "quantize_and_store_kv": "sparse_mla.ops.store_kv",
    "abs_indices_to_kvcache_indices_triton": "sparse_mla.ops.index_convert",
}


def __getattr__(name: str):
    """Lazy attributes: the Triton kernel modules are imported on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sparse_mla' has no attribute {name!r}")
