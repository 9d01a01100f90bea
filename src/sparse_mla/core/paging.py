"""Paging helpers for Triton kernels: a slot's cache record, a logical position's slot through a
block table. Imports Triton: only kernel modules import it."""

import triton
import triton.language as tl

__all__ = ["slot_records", "table_slots"]


@triton.jit
def slot_records(slot_ptr, stride_slot, n, num_slots, pbs, stride_blk, BLOCK_T: tl.constexpr):
    """This program's ``BLOCK_T`` tokens of a paged-cache write: ``(toks, valid, off, base)`` with
    ``valid`` false past ``n`` and for a slot outside ``[0, num_slots)`` (-1 included; such a
    token is never written), ``off`` its row in the page block and ``base`` the block's byte offset
    (``block * stride_blk``, int64); slot 0's for invalid tokens."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_n = toks < n
    slot = tl.load(slot_ptr + toks.to(tl.int64) * stride_slot, mask=in_n, other=-1).to(tl.int64)
    valid = in_n & (slot >= 0) & (slot < num_slots)
    safe = tl.where(valid, slot, 0)
    blk = safe // pbs
    return toks, valid, safe - blk * pbs, blk * stride_blk


@triton.jit
def table_slots(t, bt_row, stride_col, n_log, pbs, mask):
    """Cache slots ``bt_row[t // pbs] * pbs + t % pbs`` (int64) of logical positions ``t`` (int64)
    through one block-table row of ``n_log`` entries (``stride_col`` apart); ``-1`` where ``t`` is
    negative, past int32 (no int32 position or index is) or masked off (``mask``), its block lies
    past the row, the entry is negative (an unallocated block) or the slot is past int32. The
    int32 bound is tested on the entry before the product, which an int64 entry near 2^63 would
    wrap into a valid-looking slot. Block and offset come from one int32 division (an int64 one
    is a long software sequence on GPUs, repeated for every position a thread holds). Shared by
    this module's kernel and the indexer's top-k
    (:func:`sparse_mla.indexer.topk.topk_kvcache_indices`)."""
    in_range = (t >= 0) & (t <= 2147483647)
    t32 = tl.where(in_range, t, 0).to(tl.int32)
    lb = t32 // pbs
    ok = in_range & (lb < n_log)
    phys = tl.load(bt_row + lb.to(tl.int64) * stride_col, mask=mask & ok, other=-1).to(tl.int64)
    off = t32 - lb * pbs
    ok = ok & (phys >= 0) & (phys <= 2147483647)
    slot = phys * pbs + off  # below 2^62: no wrap once the entry is below 2^31
    return tl.where(ok & (slot <= 2147483647), slot, -1)
