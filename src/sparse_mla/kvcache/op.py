"""The cache-writing path as ``torch.library`` custom ops (with fake implementations, for
``torch.compile``): ``torch.ops.sparse_mla.quantize_and_store_kv`` (mutates ``k_cache``) and
``torch.ops.sparse_mla.abs_indices_to_kvcache_indices``. Registered by ``import sparse_mla``; the
kernels are imported when an op first runs."""

from __future__ import annotations

import torch

__all__ = ["quantize_and_store_kv", "abs_indices_to_kvcache_indices", "OPS"]

#: the registered operator names
OPS = ("sparse_mla::quantize_and_store_kv", "sparse_mla::abs_indices_to_kvcache_indices")


@torch.library.custom_op("sparse_mla::quantize_and_store_kv", mutates_args=("k_cache",))
def quantize_and_store_kv(kv: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Fused FP8 quantise + paged-cache write in place (``torch.ops.sparse_mla.quantize_and_store_kv``).

    See :func:`sparse_mla.kvcache.store.quantize_and_store_kv` for the arguments (kv ``[n, d_qk]``
    bf16, slot_mapping ``[n]`` int64, k_cache ``[num_blocks, page_block_size, 1, 656 | 584]``
    fp8/uint8) and the errors raised.
    """
    from .store import quantize_and_store_kv as _store

    _store(kv, slot_mapping, k_cache)


@torch.library.custom_op("sparse_mla::abs_indices_to_kvcache_indices", mutates_args=())
def abs_indices_to_kvcache_indices(
    abs_indices: torch.Tensor, block_table: torch.Tensor, page_block_size: int
) -> torch.Tensor:
    """Logical top-k positions -> cache indices (``torch.ops.sparse_mla.abs_indices_to_kvcache_indices``).

    See :func:`sparse_mla.kvcache.index_convert.abs_indices_to_kvcache_indices_triton`: abs_indices
    ``[b, s_q, topk]`` int32, block_table ``[b, max_blocks]`` int32, page_block_size > 0; returns
    ``[b, s_q, topk]`` int32 (``-1`` for invalid positions).
    """
    from .index_convert import abs_indices_to_kvcache_indices_triton

    return abs_indices_to_kvcache_indices_triton(abs_indices, block_table, page_block_size)


@quantize_and_store_kv.register_fake
def _(kv, slot_mapping, k_cache):
    return None


@abs_indices_to_kvcache_indices.register_fake
def _(abs_indices, block_table, page_block_size):
    return torch.empty_like(abs_indices, dtype=torch.int32, memory_format=torch.contiguous_format)
