"""The tile schedule made on the device from ``topk_length``/``extra_topk_length`` (the decode's
stage 3 when the lengths vary; :mod:`sparse_mla.decode.scheduler` describes the partition).
Twin: :func:`sparse_mla.decode.scheduler.schedule_from_lengths`.

One program per partition. Each reads the lengths (``CHUNK`` batches at a time), lays the batches'
costs end to end and finds the blocks of its own range: no program waits for another, and the
partition's row depends on nothing but the lengths. The partitions are equal spans of the cost line (blocks plus a
fixed overhead per batch), except that batches of one cost are never split when a whole number
of them fits the host scheduler's payload: the host's partition then (every batch at ``topk``, the
common case with lengths given), with no combine work. Program 0 also writes the per-batch tensors
(``main_blocks``, ``num_blocks``, the ``num_splits`` and ``acc_rows`` prefix sums, the list of
split batches). Launched on the
decode's stream before the decode kernel, it is part of every call: the schedule always belongs to
the lengths the step runs with, eagerly and in CUDA-graph replays. Where the target has
programmatic dependent launch (sm_90+) the decode kernel is launched as its dependent: its
programs are scheduled while this one runs, set up their shared memory, and wait
(``griddepcontrol.wait``) for this grid to complete before they read the table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.env import next_pow2, require_runnable
from ...core.launcher import launch as launch_kernel
from ...core.target import pdl_enabled
from ..scheduler import FIXED_OVERHEAD_NUM_BLOCKS, TOPK_BLOCK_SIZE, ScheduleTable

__all__ = ["schedule_fwd", "MAX_CHUNK"]

#: batches one program reads at a time
MAX_CHUNK = 1024


@triton.jit
def _blocks(len_ptr, i, mask, full, cap, HAS_LEN: tl.constexpr, SB: tl.constexpr):
    """Blocks of ``SB`` positions per batch ``i``: ``ceil(clamp(len, 0, cap) / SB)``, or ``full``."""
    if HAS_LEN:
        n = tl.load(len_ptr + i, mask=mask, other=0).to(tl.int64)
        n = tl.minimum(tl.maximum(n, 0), cap)
        return (n + SB - 1) // SB
    else:
        return tl.zeros_like(i).to(tl.int64) + full


# the sizes are never specialised: Triton 3.6 folds an int argument equal to 1 into a constant,
# and the conversion to LLVM then fails on this kernel for num_parts == 1
@triton.jit(do_not_specialize=["b", "topk", "extra_topk", "num_parts"])
def _schedule_kernel(
    len_ptr,
    extra_len_ptr,
    meta_ptr,
    nsplit_ptr,
    acc_ptr,
    main_ptr,
    nblk_ptr,
    list_ptr,
    b,
    topk,
    extra_topk,
    num_parts,
    HAS_LEN: tl.constexpr,
    HAS_EXTRA_LEN: tl.constexpr,
    OVERHEAD: tl.constexpr,
    SB: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # the decode, launched as this grid's programmatic dependent, may start its prologue
        tl.extra.cuda.gdc_launch_dependents()  # now; it waits for this grid to complete before reading the table
    p = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    main_full = (topk.to(tl.int64) + SB - 1) // SB
    extra_full = (extra_topk.to(tl.int64) + SB - 1) // SB
    # the length of the cost line, and the least and most cost of a batch
    total = tl.zeros([], tl.int64)
    c_min = tl.zeros([], tl.int64) + (1 << 62)
    c_max = tl.zeros([], tl.int64)
    c0 = 0
    while c0 < b:  # (while loops: the interpreter's range() cannot take a runtime bound with NumPy >= 2.4)
        i = c0 + offs
        m = i < b
        mb = _blocks(len_ptr, i, m, main_full, topk, HAS_LEN, SB)
        eb = _blocks(extra_len_ptr, i, m, extra_full, extra_topk, HAS_EXTRA_LEN, SB)
        cost = tl.maximum(mb + eb, 1) + OVERHEAD
        total += tl.sum(tl.where(m, cost, 0))
        c_min = tl.minimum(c_min, tl.min(tl.where(m, cost, 1 << 62), 0))
        c_max = tl.maximum(c_max, tl.max(tl.where(m, cost, 0), 0))
        c0 += CHUNK
    cap = (total + num_parts - 1) // num_parts
    # batches of one cost that fit whole in the host scheduler's payload (cap + overhead): a
    # partition takes a whole number of them, as the host scheduler does, instead of splitting
    whole = (cap + c_max - 1) // c_max * c_max
    cap = tl.where((c_min == c_max) & (whole <= cap + OVERHEAD), whole, cap)
    start = p * cap
    end = tl.minimum(start + cap, total)
    # this partition's first batch (its cost span holds `start`) and last one (its blocks begin
    # before `end`), each found by the one batch that satisfies a pair of comparisons
    first = tl.zeros([], tl.int64)
    c_first = tl.zeros([], tl.int64)
    last = tl.zeros([], tl.int64) - 1
    c_last = tl.zeros([], tl.int64)
    n_last = tl.zeros([], tl.int64)
    carry = tl.zeros([], tl.int64)  # cost of the batches before the chunk
    splits = tl.zeros([], tl.int64)
    rows = tl.zeros([], tl.int64)
    listed = tl.zeros([], tl.int64)  # split batches listed so far
    c0 = 0
    while c0 < b:
        i = c0 + offs
        m = i < b
        mb = _blocks(len_ptr, i, m, main_full, topk, HAS_LEN, SB)
        eb = _blocks(extra_len_ptr, i, m, extra_full, extra_topk, HAS_EXTRA_LEN, SB)
        n = tl.maximum(mb + eb, 1)
        cost = tl.where(m, n + OVERHEAD, 0)
        c_next = carry + tl.cumsum(cost, 0)
        c = c_next - cost
        is_first = m & (c <= start) & (start < c_next)
        first += tl.sum(tl.where(is_first, i, 0))
        c_first += tl.sum(tl.where(is_first, c, 0))
        is_last = m & (c + OVERHEAD < end) & (end <= c_next + OVERHEAD)
        last += tl.sum(tl.where(is_last, i + 1, 0))
        c_last += tl.sum(tl.where(is_last, c, 0))
        n_last += tl.sum(tl.where(is_last, n, 0))
        if p == 0:
            pieces = (c_next - 1) // cap - (c + OVERHEAD) // cap + 1
            pieces = tl.where(m, pieces, 0)
            acc = tl.where(pieces > 1, pieces, 0)
            tl.store(main_ptr + i, mb.to(tl.int32), mask=m)
            tl.store(nblk_ptr + i, n.to(tl.int32), mask=m)
            tl.store(nsplit_ptr + 1 + i, (splits + tl.cumsum(pieces, 0)).to(tl.int32), mask=m)
            tl.store(acc_ptr + 1 + i, (rows + tl.cumsum(acc, 0)).to(tl.int32), mask=m)
            is_split = (pieces > 1).to(tl.int64)
            rank = listed + tl.cumsum(is_split, 0)  # 1-based among the split batches
            tl.store(list_ptr + rank, i.to(tl.int32), mask=(is_split > 0) & (rank <= num_parts))
            splits += tl.sum(pieces)
            rows += tl.sum(acc)
            listed += tl.sum(is_split)
        carry = tl.max(c_next, 0)
        c0 += CHUNK
    if p == 0:
        tl.store(nsplit_ptr, 0)
        tl.store(acc_ptr, 0)
        tl.store(list_ptr, listed.to(tl.int32))
    busy = (first <= last) & (start < total)
    begin_block = tl.maximum(start - c_first - OVERHEAD, 0)
    end_block = tl.minimum(n_last, end - c_last - OVERHEAD)
    begin_split = p - (c_first + OVERHEAD) // cap
    row = meta_ptr + p * 8
    tl.store(row + 0, tl.where(busy, first, b).to(tl.int32))
    tl.store(row + 1, tl.where(busy, last, b - 1).to(tl.int32))
    tl.store(row + 2, tl.where(busy, begin_block, 0).to(tl.int32))
    tl.store(row + 3, tl.where(busy, end_block, 0).to(tl.int32))
    tl.store(row + 4, tl.where(busy, begin_split, 0).to(tl.int32))
    tl.store(row + 5, (busy & (begin_split > 0)).to(tl.int32))
    tl.store(row + 6, (busy & (end_block < n_last)).to(tl.int32))
    tl.store(row + 7, 0)


def schedule_fwd(
    topk_length: torch.Tensor | None,
    extra_topk_length: torch.Tensor | None,
    topk: int,
    extra_topk: int,
    into: ScheduleTable,
) -> ScheduleTable:
    """Write the schedule of these lengths into ``into``'s tensors (a ``dynamic`` table of
    ``b`` batches and ``num_sm_parts`` partitions on the lengths' device) and return it.

    Args:
        topk_length: ``[b]`` int32 (contiguous) or None (every batch has ``topk``).
        extra_topk_length: ``[b]`` int32 (contiguous) or None (every batch has ``extra_topk``).
        topk, extra_topk: index slots of the main and extra cache (``extra_topk`` 0: no extra cache).
        into: the table whose ``metadata``, ``num_splits``, ``acc_rows``, ``main_blocks``,
            ``num_blocks_t`` and ``split_list`` are written (:func:`sparse_mla.decode.plan.dynamic_table`).
    """
    require_runnable(_schedule_kernel, into.metadata.device, _blocks)
    b = into.main_blocks.shape[0]
    dummy = into.acc_rows
    args = (
        topk_length if topk_length is not None else dummy,
        extra_topk_length if extra_topk_length is not None else dummy,
        into.metadata,
        into.num_splits,
        into.acc_rows,
        into.main_blocks,
        into.num_blocks_t,
        into.split_list,
        b,
        topk,
        extra_topk,
        into.num_sm_parts,
    )
    consts = dict(
        HAS_LEN=topk_length is not None,
        HAS_EXTRA_LEN=extra_topk_length is not None,
        OVERHEAD=FIXED_OVERHEAD_NUM_BLOCKS,
        SB=TOPK_BLOCK_SIZE,
        CHUNK=min(max(next_pow2(b), 16), MAX_CHUNK),
        PDL=pdl_enabled(into.metadata.device),
    )
    launch_kernel(_schedule_kernel, (into.num_sm_parts, 1, 1), args, consts, {"num_warps": 4})
    return into
