"""Cache formats: the FP8 layouts (V32, MODEL1), their checks and their quantisation (pure PyTorch).

:mod:`.gather` holds the Triton helpers that load and dequantise a block of cache records inside a
kernel; it imports Triton, so only kernel modules import it."""

from .layouts import (
    MODEL1,
    V32,
    KVCacheLayout,
    LayoutLike,
    cache_bytes,
    check_cache,
    check_cache_alignment,
    check_quantized_cache,
    get_layout,
    layout_of_cache,
    num_cache_tokens,
)
from .quant import dequantize_k_cache, gather_dequant_tokens, quantize_k_cache, ue8m0_scale

__all__ = [
    "KVCacheLayout",
    "V32",
    "MODEL1",
    "LayoutLike",
    "get_layout",
    "layout_of_cache",
    "cache_bytes",
    "check_quantized_cache",
    "check_cache",
    "check_cache_alignment",
    "num_cache_tokens",
    "quantize_k_cache",
    "dequantize_k_cache",
    "gather_dequant_tokens",
    "ue8m0_scale",
]
