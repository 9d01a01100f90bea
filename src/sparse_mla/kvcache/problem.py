"""Argument checks of the serving-path operations, shared by the kernels, their PyTorch twins and
the custom ops (pure PyTorch: importing this module imports no Triton)."""

from __future__ import annotations

import torch

from ..core.checks import check_block_table, check_plain_storage
from ..formats import (
    KVCacheLayout,
    LayoutLike,
    check_cache_alignment,
    check_quantized_cache,
    get_layout,
    layout_of_cache,
)

__all__ = ["check_store_args", "check_abs_index_args"]


def check_store_args(
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    layout: LayoutLike | None = None,
) -> KVCacheLayout:
    """Validate the arguments of :func:`quantize_and_store_kv` (no device synchronisation).

    Returns the cache layout. Raises ``TypeError``/``ValueError`` naming the bad argument; slot
    values are range-checked only when ``slot_mapping`` is on the CPU.
    """
    lay = layout_of_cache(k_cache)
    if layout is not None:
        want = get_layout(layout)
        if want != lay:
            raise ValueError(
                f"layout: {want.name} given, but k_cache has {k_cache.shape[-1]} bytes per token ({lay.name})"
            )
    check_quantized_cache(k_cache, lay, "k_cache")
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv: expected a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype != torch.bfloat16:
        raise TypeError(f"kv: expected dtype torch.bfloat16, got {kv.dtype}")
    if kv.dim() != 2 or kv.shape[1] != lay.d_qk:
        raise ValueError(f"kv: expected shape [n, {lay.d_qk}] (d_qk of the {lay.name} cache), got {list(kv.shape)}")
    if kv.numel() and kv.stride(1) != 1:
        raise ValueError(f"kv: the last dimension must be contiguous (stride 1), got strides {list(kv.stride())}")
    check_plain_storage(kv, "kv")  # the kernel reads its raw bits, inside its storage
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping: expected a torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"slot_mapping: expected dtype torch.int64 (or torch.int32), got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != kv.shape[0]:
        raise ValueError(f"slot_mapping: expected shape [n={kv.shape[0]}], got {list(slot_mapping.shape)}")
    check_plain_storage(slot_mapping, "slot_mapping")
    if kv.device != k_cache.device:
        raise ValueError(f"kv: expected a tensor on {k_cache.device} (where k_cache is), got {kv.device}")
    if slot_mapping.device != k_cache.device:
        raise ValueError(
            f"slot_mapping: expected a tensor on {k_cache.device} (where k_cache is), got {slot_mapping.device}"
        )
    # the kernel stores float32 scales (V32) and int16 RoPE halves through typed pointers
    check_cache_alignment(k_cache, lay, "k_cache")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        n_slots = int(k_cache.shape[0]) * int(k_cache.shape[1])
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= n_slots:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"slot_mapping: values must be -1 (skip) or in [0, {n_slots}) (num_blocks * page_block_size), got {bad}"
            )
    return lay


def check_abs_index_args(abs_indices: torch.Tensor, block_table: torch.Tensor, page_block_size: int) -> None:
    """Argument checks shared by :func:`abs_indices_to_kvcache_indices` and its Triton twin."""
    if not isinstance(abs_indices, torch.Tensor) or abs_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError("abs_indices: expected an int32 tensor [b, s_q, topk]")
    if abs_indices.dim() != 3:
        raise ValueError(f"abs_indices: expected shape [b, s_q, topk], got {list(abs_indices.shape)}")
    check_plain_storage(abs_indices, "abs_indices")
    check_block_table(block_table, abs_indices.shape[0], abs_indices.device, page_block_size)
