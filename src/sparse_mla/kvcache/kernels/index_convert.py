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

from ...core.env import cdiv, next_pow2, require_runnable
from ...core.paging import table_slots

__all__ = ["launch"]


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


def launch(
    abs_indices: torch.Tensor, block_table: torch.Tensor, page_block_size: int, out: torch.Tensor
) -> torch.Tensor:
    """Launch the kernel on validated arguments, writing ``out`` (returned)."""
    dev = abs_indices.device
    b, s_q, topk = abs_indices.shape
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
