"""Logical top-k positions → cache indices through a block table, on the device (validation and
``backend=`` here; the kernel in :mod:`.kernels.index_convert`; the twin in :mod:`.reference`).
Importing this module imports no Triton."""

from __future__ import annotations

import torch

from ..core.checks import check_no_self_overlap, check_plain_storage
from ..core.env import on_tensor_device
from .backends import KVCACHE_BACKENDS
from .problem import check_abs_index_args

__all__ = ["abs_indices_to_kvcache_indices_triton"]


@on_tensor_device
def abs_indices_to_kvcache_indices_triton(
    abs_indices: torch.Tensor,
    block_table: torch.Tensor,
    page_block_size: int,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Triton twin of :func:`sparse_mla.kvcache.abs_indices_to_kvcache_indices` (identical results).

    Runs the kernel on CUDA and under ``TRITON_INTERPRET=1``; elsewhere (CPU without the
    interpreter) it calls the PyTorch function.

    Args:
        abs_indices: ``[b, s_q, topk]`` int32 (int64 accepted): logical token position of each
            selected key inside its request; ``-1`` (any negative) = no token.
        block_table: ``[b, max_blocks_per_seq]`` int32 (int64 accepted): physical page block of
            each logical block of each request; negative = not allocated.
        page_block_size: tokens per page block (> 0).
        out: optional ``[b, s_q, topk]`` int32 tensor to write into (e.g. a CUDA-graph buffer).
        backend: ``"auto"``, ``"portable"`` (the Triton kernel) or ``"reference"`` (the PyTorch
            function), resolved as every operation's (:mod:`sparse_mla.core.backend`).

    Returns:
        ``[b, s_q, topk]`` int32 cache indices (``block * page_block_size + offset``), ``-1`` where
        the position is negative or past int32, beyond the block table, or maps to a negative block or past int32.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes, devices, ``page_block_size``, ``out`` or ``backend``.
    """
    check_abs_index_args(abs_indices, block_table, page_block_size)
    page_block_size = int(page_block_size)  # (a NumPy integer passes the check)
    b, s_q, topk = abs_indices.shape
    if out is None:
        out = torch.empty(b, s_q, topk, dtype=torch.int32, device=abs_indices.device)
    else:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.int32:
            raise TypeError("out: expected an int32 tensor [b, s_q, topk]")
        if tuple(out.shape) != (b, s_q, topk) or out.device != abs_indices.device:
            raise ValueError(
                f"out: expected shape {[b, s_q, topk]} on {abs_indices.device}, got {list(out.shape)} on {out.device}"
            )
        check_plain_storage(out, "out")
        check_no_self_overlap(out, "out")
    dev = abs_indices.device
    kernels = KVCACHE_BACKENDS.runs_kernels(dev, backend)
    if out.numel() == 0:
        return out
    if not kernels:
        from .reference import abs_indices_to_kvcache_indices

        out.copy_(abs_indices_to_kvcache_indices(abs_indices, block_table, page_block_size))
        return out
    from .kernels.index_convert import launch

    return launch(abs_indices, block_table, page_block_size, out)
