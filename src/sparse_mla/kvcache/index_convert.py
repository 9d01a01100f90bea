"""Logical top-k positions -> paged-cache indices on the device (serving path).

The indexer of DeepSeek Sparse Attention picks, per query token, the logical positions of the
``topk`` keys inside its request; the decode kernel wants cache indices
``block_table[i, t // page_block_size] * page_block_size + t % page_block_size``. This kernel does
the conversion without any host synchronisation (CUDA-graph safe). Its PyTorch twin is
:func:`sparse_mla.kvcache.abs_indices_to_kvcache_indices` (also sync-free; the kernel does it in
one launch instead of about ten).

One program converts ``BLOCK`` positions of one ``(batch, s_q)`` row. A position is invalid (result
``-1``) when it is negative, its logical block lies outside the block table, or the table entry
is negative (an unallocated block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.checks import check_no_self_overlap, check_plain_storage
from ..core.env import cdiv, next_pow2, on_tensor_device, require_runnable
from ..core.paging import table_slots
from .backends import runs_kernels
from .problem import check_abs_index_args

__all__ = ["abs_indices_to_kvcache_indices_triton"]


@triton.jit
def _abs_to_cache_kernel(
    abs_ptr,
    stride_ab,
    stride_as,
    stride_at,
    bt_ptr,
    stride_tb,
    stride_tn,
    n_log,
    out_ptr,
    stride_ob,
    stride_os,
    stride_ot,
    s_q,
    topk,
    pbs,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cb = tl.program_id(1)
    bi = row // s_q
    si = row - bi * s_q
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < topk
    t = tl.load(abs_ptr + bi * stride_ab + si * stride_as + cols * stride_at, mask=cmask, other=-1).to(tl.int64)
    res = table_slots(t, bt_ptr + bi * stride_tb, stride_tn, n_log, pbs, cmask)
    tl.store(out_ptr + bi * stride_ob + si * stride_os + cols * stride_ot, res.to(tl.int32), mask=cmask)


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
        the position is negative, beyond the block table, or maps to a negative block or past int32.

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
    kernels = runs_kernels(dev, backend)
    if out.numel() == 0:
        return out
    if not kernels:
        from .reference import abs_indices_to_kvcache_indices

        out.copy_(abs_indices_to_kvcache_indices(abs_indices, block_table, page_block_size))
        return out
    require_runnable(_abs_to_cache_kernel, dev, table_slots)
    n_log = block_table.shape[1]
    bt = block_table if n_log > 0 else torch.full((b, 1), -1, dtype=block_table.dtype, device=dev)
    block = min(1024, next_pow2(topk))
    grid = (b * s_q, cdiv(topk, block))
    _abs_to_cache_kernel[grid](
        abs_indices,
        *abs_indices.stride(),
        bt,
        bt.stride(0),
        bt.stride(1),
        n_log,
        out,
        *out.stride(),
        s_q,
        topk,
        page_block_size,
        BLOCK=block,
        num_warps=4,
    )
    return out
