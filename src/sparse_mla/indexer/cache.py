"""The indexer key cache and its fused quantise-and-store (DeepSeek-V3.2's lightning indexer; DeepGEMM's / vLLM's layout).

Cache: ``[num_blocks, block_size, 1, head_dim + 4]`` uint8, block-major: a block's ``block_size x
head_dim`` e4m3 bytes (token ``o`` at byte ``o * head_dim``), then its ``block_size`` fp32 scales
(token ``o`` at byte ``block_size * head_dim + 4 * o``). A key's value is ``e4m3 * scale``.

:func:`indexer_k_quant_and_cache` writes new keys: per token ``amax = max(|k|, 1e-4)``, ``scale =
amax / 448`` (``scale_fmt=None``) or ``2^ceil(log2(amax / 448))`` (``"ue8m0"``, DeepSeek-V3.2's
power-of-two scales), values ``k / scale`` clamped to ±448 and rounded to e4m3 (nearest even).
One program per ``BLOCK_T`` tokens; the bytes equal its twin
:func:`sparse_mla.indexer.reference.indexer_k_quant_and_cache_reference` (the UE8M0 exponent from
the float bits of ``amax``, the e4m3 rounding by integer operations, divisions correctly rounded:
the same on every GPU and in the interpreter). Slots outside ``[0, num_blocks * block_size)``
(``-1`` for padding) are never written. Two tokens with one slot race: give distinct slots.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.env import on_tensor_device
from ..core.traced import deferred_output
from .backends import INDEXER_BACKENDS
from .problem import check_index_cache, check_tensor_arg
from .reference import dequantize_indexer_cache as _dequantize
from .reference import indexer_k_quant_and_cache_reference

__all__ = ["indexer_k_quant_and_cache", "dequantize_indexer_cache", "SCALE_FMTS"]

SCALE_FMTS = ("ue8m0", None)


def _check_args(k: Any, kv_cache: Any, slot_mapping: Any, scale_fmt: Any) -> int:
    d = check_index_cache(kv_cache)
    check_tensor_arg(k, "k", (torch.bfloat16, torch.float16, torch.float32), 2, kv_cache.device)
    if k.shape[1] != d:
        raise ValueError(f"k: expected shape [n, head_dim={d}] (the cache's head_dim), got {list(k.shape)}")
    if k.numel() and k.stride(1) != 1:
        raise ValueError("k: the last dimension must be contiguous (stride 1)")
    check_tensor_arg(slot_mapping, "slot_mapping", (torch.int64, torch.int32), 1, kv_cache.device)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping: expected shape [n={k.shape[0]}], got {list(slot_mapping.shape)}")
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt: expected 'ue8m0' or None, got {scale_fmt!r}")
    return d


@on_tensor_device
def indexer_k_quant_and_cache(
    k: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_fmt: str | None = "ue8m0",
    *,
    backend: str = "auto",
) -> None:
    """Quantise new indexer keys to FP8 and write them in place into the paged key cache.

    Args:
        k: ``[n, head_dim]`` bf16 (fp16/fp32 accepted), last dim contiguous; head_dim 16..256, a
            power of two (DeepSeek-V3.2: 128).
        kv_cache: ``[num_blocks, block_size, 1, head_dim + 4]`` uint8, block-major (module doc);
            written in place.
        slot_mapping: ``[n]`` int64 (or int32) ``block * block_size + offset``; slots outside the
            cache (``-1`` padding) are skipped.
        scale_fmt: ``"ue8m0"`` (power-of-two scales) or None (``amax / 448``).
        backend: ``"auto"``, ``"portable"`` (the Triton kernels) or ``"reference"`` (the PyTorch
            twin), resolved as every operation's (:mod:`sparse_mla.core.backend`).

    Runs the Triton kernel on CUDA and under ``TRITON_INTERPRET=1``, else the PyTorch twin; the
    bytes are the same. No host synchronisation (CUDA-graph safe).

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype, shape, stride or device, or
            a ``backend`` that is unknown or cannot serve the tensors' device.
    """
    if torch.compiler.is_compiling():  # one operator in the graph (its tensors checked when it runs)
        if scale_fmt not in SCALE_FMTS:  # fixed while tracing: raised when the graph runs
            deferred_output(ValueError(f"scale_fmt: expected 'ue8m0' or None, got {scale_fmt!r}"), k, (0,))
            return
        torch.ops.sparse_mla.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, scale_fmt, backend)
        return
    d = _check_args(k, kv_cache, slot_mapping, scale_fmt)
    kernels = INDEXER_BACKENDS.runs_kernels(kv_cache.device, backend)
    n = k.shape[0]
    if n == 0:
        return
    if not kernels:
        indexer_k_quant_and_cache_reference(k, kv_cache, slot_mapping, scale_fmt)
        return
    from .kernels import launch_quant_store

    launch_quant_store(k, kv_cache, slot_mapping, d, scale_fmt == "ue8m0")


def dequantize_indexer_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and scales stored in an indexer key cache (any device; PyTorch operations).

    Args:
        kv_cache: ``[num_blocks, block_size, 1, head_dim + 4]`` uint8, block-major (module doc).

    Returns:
        ``(keys [num_blocks * block_size, head_dim] fp32 e4m3 values, scales [num_blocks *
        block_size] fp32)``: slot ``s``'s key is ``keys[s] * scales[s]``.

    Raises:
        TypeError / ValueError: ``kv_cache`` of the wrong type, dtype, shape or layout.
    """
    check_index_cache(kv_cache)
    return _dequantize(kv_cache)
