"""Portable split-KV decode kernel in Triton ``tl`` (steps 5-15 in docs/design.md) and its
launcher: any GPU Triton supports, and the CPU under Triton's interpreter. Twins:
:func:`sparse_mla.decode.reference.sparse_decode_split_reference`, and for the dense decode
:func:`sparse_mla.decode.reference.dense_decode_reference`.

The dense decode (``flash_mla_with_kvcache`` without ``indices``) is this kernel with request
``i``'s list being its positions ``0 .. cache_seqlens[i] - 1`` turned into cache slots through its
block-table row (``SLOTS_BLOCK_TABLE``, or ``SLOTS_BLOCK_TABLE_WIDE`` for pages of 64 tokens or more; ``causal``: query token ``j`` of ``s_q`` stops at position
``cache_seqlens[i] - s_q + j``), over an FP8 cache or bf16/fp16 rows (``KV_FP8`` False): the same
schedule from the lengths, split rows and combine. Compiled, fp16 rows take fp16 dot operands.

One program serves one scheduler partition, one query token (``s_q`` index) and ``BLOCK_H``
query heads. It walks the (batch, 64-index block) pieces the tile scheduler gave its partition;
per block it gathers the 64 indexed tokens of the FP8 paged cache, dequantises them, computes
``QKᵀ`` over ``d_qk``, runs the online softmax in exp2 space and accumulates ``P·V`` over
``d_v = 512`` in fp32. A batch that the scheduler did not split gets its final bf16 ``out`` and
natural-log ``lse`` here (attn_sink applied); pieces of split batches write fp32 partial O and
log2-space LSE for :mod:`.combine`.

Layout of the dequantised key inside the kernel: ``K_main [64, 512]`` (V32: the 512 NoPE values;
MODEL1: 448 NoPE values followed by the 64 RoPE values) and, for V32 only, ``K_tail [64, 64]``
(the RoPE part). ``V = K_main`` in both layouts. Invalid tokens are never loaded (masked loads
with 0 as the fill value), so NaN or garbage in unused cache slots cannot reach P·V.

Kernel arguments travel as tuples (Triton passes their members as separate arguments):
``cache = (ptr, block_stride, token_stride, num_tokens, page_block_size, log2(page_block_size))``
(bytes; elements for bf16/fp16 rows), ``sel = (indices_ptr, stride_b, stride_s, stride_t, topk,
topk_length_ptr)`` (dense: ``(block_table_ptr, stride_b, s_q - 1 if causal else 0, stride_col,
max_blocks * page_block_size, cache_seqlens_ptr)``),
``sched = (metadata_ptr, acc_rows_ptr, main_blocks_ptr, num_blocks_ptr)`` and
``(ptr, strides...)`` for each output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...core.env import LOG2E, cdiv, interpreting, require_runnable
from ...core.launcher import launch_fitting
from ...core.target import device_target
from ...formats.gather import (
    SLOTS_BLOCK_TABLE_WIDE,
    SLOTS_INDICES,
    block_table_slots,
    cache_args,
    dot_consts,
    gather_consts,
    load_block_keys,
    load_paged_rows,
    paged_block_offset,
    paged_positions,
    row_cache_args,
)
from ..problem import DecodeProblem, finish_outputs, output_tensors
from ..scheduler import TOPK_BLOCK_SIZE, ScheduleTable, small_head_tile
from ..workspace import split_accumulators
from .combine import combine_fwd, final_out_lse

__all__ = ["PortableConfig", "launch"]


@dataclass(frozen=True)
class PortableConfig:
    """Launch parameters of the portable kernel (defaults: the measured best on the H200).

    Attributes:
        block_n: tokens gathered per step (a power of two dividing 64).
        num_warps: warps per program.
        num_stages: software-pipeline stages of the gather (compiled kernels; lowered automatically
            when a variant does not fit in shared memory).
    """

    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps", "num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PortableConfig.{name}: expected a positive int, got {v!r}")
        if TOPK_BLOCK_SIZE % self.block_n or self.block_n & (self.block_n - 1):
            raise ValueError(
                f"PortableConfig.block_n: expected a power of two dividing {TOPK_BLOCK_SIZE}, got {self.block_n}"
            )


@triton.jit
def _block_step(
    q_main,
    q_tail,
    m_i,
    l_i,
    acc,
    cache,
    sel,
    req,
    sq,
    blk_i,
    n_valid,
    scale_log2,
    ADDR: tl.constexpr,
    IS_V32: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_NOPE: tl.constexpr,
    D_TAIL: tl.constexpr,
    TILE: tl.constexpr,
    MAIN_TILES: tl.constexpr,
    NUM_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FP8_HW: tl.constexpr,
    SLOTS: tl.constexpr,
    KV_FP8: tl.constexpr,
    RESCALE_TAU: tl.constexpr = 8.0,
):
    """One BLOCK_N-token step of the online softmax; returns the updated (m, l, acc). The keys: FP8
    records (``KV_FP8``) at the slots of an indices tensor or of block-table positions (``SLOTS``),
    else bf16/fp16 rows at block-table positions (the dense decode)."""
    if not KV_FP8:
        k_main, k_tail, valid = load_paged_rows(
            cache, sel, req, sq, blk_i * BLOCK_N, n_valid, IS_V32, BLOCK_N, DOT_DTYPE, SLOTS == SLOTS_BLOCK_TABLE_WIDE
        )
    else:
        k_main, k_tail, valid = load_block_keys(
            cache,
            sel,
            req,
            sq,
            blk_i * BLOCK_N,
            n_valid,
            ADDR,
            IS_V32,
            D_MAIN,
            D_NOPE,
            D_TAIL,
            TILE,
            MAIN_TILES,
            NUM_TILES,
            BLOCK_N,
            DOT_DTYPE,
            FP8_HW,
            SLOTS,
        )
    s = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PREC)
    if IS_V32:
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=DOT_PREC)
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    # A row's running max moves only when the block's max exceeds it by more than RESCALE_TAU
    # (log2 units), so P stays <= 2^RESCALE_TAU and alpha is 1 in most steps. (-inf - -inf is
    # NaN, and NaN > tau is False: rows with nothing valid stay.)
    m_blk = tl.max(s, axis=1)
    grow = (m_blk - m_i) > RESCALE_TAU
    m_new = tl.where(grow, m_blk, m_i)
    alpha = tl.where(grow, tl.exp2(m_i - m_new), 1.0)
    acc = acc * alpha[:, None]
    l_i = l_i * alpha
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    l_i += tl.sum(p, axis=1)
    acc = tl.dot(p.to(DOT_DTYPE), k_main, acc=acc, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_blocks(
    q_main,
    q_tail,
    m_i,
    l_i,
    acc,
    cache,
    sel,
    req,
    sq,
    blk_begin,
    blk_end,
    scale_log2,
    ADDR: tl.constexpr,
    IS_V32: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_NOPE: tl.constexpr,
    D_TAIL: tl.constexpr,
    TILE: tl.constexpr,
    MAIN_TILES: tl.constexpr,
    NUM_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCHED_BLOCK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FP8_HW: tl.constexpr,
    HAS_LEN: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SLOTS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax over scheduler blocks [blk_begin, blk_end) of one cache, BLOCK_N tokens a step.

    Compiled, a ``tl.range`` loop lets Triton's pipeliner prefetch the next steps' gathers
    (``NUM_STAGES``); under the interpreter a while loop runs instead (Triton 3.6's interpreter
    cannot take loaded values as range() bounds with NumPy >= 2.4). Returns the updated (m, l, acc).
    """
    _idx_ptr, _sb, _ss, _st, topk, len_ptr = sel
    n_valid = topk
    if HAS_LEN:
        n_valid = tl.minimum(tl.load(len_ptr + req), topk)
    sub_begin = blk_begin * (SCHED_BLOCK // BLOCK_N)
    sub_end = blk_end * (SCHED_BLOCK // BLOCK_N)
    if FOR_LOOP:
        for blk_i in tl.range(sub_begin, sub_end, num_stages=NUM_STAGES):
            m_i, l_i, acc = _block_step(
                q_main,
                q_tail,
                m_i,
                l_i,
                acc,
                cache,
                sel,
                req,
                sq,
                blk_i,
                n_valid,
                scale_log2,
                ADDR,
                IS_V32,
                D_MAIN,
                D_NOPE,
                D_TAIL,
                TILE,
                MAIN_TILES,
                NUM_TILES,
                BLOCK_N,
                DOT_DTYPE,
                DOT_PREC,
                FP8_HW,
                SLOTS,
                KV_FP8,
            )
    else:
        blk_i = sub_begin
        while blk_i < sub_end:
            m_i, l_i, acc = _block_step(
                q_main,
                q_tail,
                m_i,
                l_i,
                acc,
                cache,
                sel,
                req,
                sq,
                blk_i,
                n_valid,
                scale_log2,
                ADDR,
                IS_V32,
                D_MAIN,
                D_NOPE,
                D_TAIL,
                TILE,
                MAIN_TILES,
                NUM_TILES,
                BLOCK_N,
                DOT_DTYPE,
                DOT_PREC,
                FP8_HW,
                SLOTS,
                KV_FP8,
            )
            blk_i += 1
    return m_i, l_i, acc


@triton.jit
def _sparse_decode_kernel(
    q,
    cache,
    sel,
    extra_cache,
    extra_sel,
    sink_ptr,
    sched,
    out,
    lse,
    o_acc,
    lse_acc,
    h_q,
    scale_log2,
    ADDR: tl.constexpr,
    EXTRA_ADDR: tl.constexpr,
    IS_V32: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_NOPE: tl.constexpr,
    D_TAIL: tl.constexpr,
    TILE: tl.constexpr,
    MAIN_TILES: tl.constexpr,
    NUM_TILES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCHED_BLOCK: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_EXTRA_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FP8_HW: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SLOTS: tl.constexpr,
    KV_FP8: tl.constexpr,
    WAIT_PRIOR: tl.constexpr = False,
):
    """Grid ``(num_sm_parts, s_q, ceil(h_q / BLOCK_H))``. ``q = (ptr, stride_b, stride_s, stride_h)``;
    ``out = (ptr, stride_b, stride_s, stride_h)``, ``lse = (ptr, stride_b, stride_h, stride_s)``;
    ``o_acc = (ptr, stride_row, stride_s, stride_h)``, ``lse_acc = (ptr, stride_row, stride_s)``
    (heads contiguous): the split rows of :func:`.workspace.split_accumulators`. ``WAIT_PRIOR``:
    launched as the programmatic dependent of the kernel that made ``sched`` (the schedule made
    from lengths), whose grid must complete before the table is read."""
    if WAIT_PRIOR:
        tl.extra.cuda.gdc_wait()
    q_ptr, stride_qb, stride_qs, stride_qh = q
    meta_ptr, nsplit_ptr, mainblk_ptr, nblk_ptr = sched
    out_ptr, stride_ob, stride_os, stride_oh = out
    lse_ptr, stride_lb, stride_lh, stride_ls = lse
    oacc_ptr, stride_ar, stride_as, stride_ah = o_acc
    lacc_ptr, stride_lr, stride_lsq = lse_acc
    part = tl.program_id(0)
    sq = tl.program_id(1)
    hb = tl.program_id(2)
    mrow = meta_ptr + part * 8
    begin_req = tl.load(mrow + 0)
    end_req = tl.load(mrow + 1)
    begin_block = tl.load(mrow + 2)
    end_block = tl.load(mrow + 3)
    begin_split = tl.load(mrow + 4)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    # offsets in int64: a view's strides can take them past 2^31 elements
    sq64 = sq.to(tl.int64)
    h64 = heads.to(tl.int64)
    cm = tl.arange(0, D_MAIN)
    ct = tl.arange(0, D_TAIL)
    sink_log2 = tl.zeros([BLOCK_H], tl.float32)
    if HAS_SINK:
        sink_log2 = tl.load(sink_ptr + heads, mask=hmask, other=float("-inf")) * 1.4426950408889634

    req = begin_req
    while req <= end_req:
        blk0 = tl.where(req == begin_req, begin_block, 0)
        blk1 = tl.where(req == end_req, end_block, tl.load(nblk_ptr + req))
        split = tl.where(req == begin_req, begin_split, 0)
        split_base = tl.load(nsplit_ptr + req)
        n_splits = tl.load(nsplit_ptr + req + 1) - split_base
        n_main = tl.load(mainblk_ptr + req)

        qrow = q_ptr + req.to(tl.int64) * stride_qb + sq64 * stride_qs + h64[:, None] * stride_qh
        q_main = tl.load(qrow + cm[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        if IS_V32:
            q_tail = tl.load(qrow + D_NOPE + ct[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        else:
            q_tail = tl.zeros([BLOCK_H, D_TAIL], dtype=DOT_DTYPE)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D_MAIN], tl.float32)
        # blocks [0, n_main) of a request are main-cache blocks, the rest extra-cache blocks
        m_i, l_i, acc = _attend_blocks(
            q_main,
            q_tail,
            m_i,
            l_i,
            acc,
            cache,
            sel,
            req,
            sq,
            blk0,
            tl.minimum(blk1, n_main),
            scale_log2,
            ADDR,
            IS_V32,
            D_MAIN,
            D_NOPE,
            D_TAIL,
            TILE,
            MAIN_TILES,
            NUM_TILES,
            BLOCK_N,
            SCHED_BLOCK,
            DOT_DTYPE,
            DOT_PREC,
            FP8_HW,
            HAS_TOPK_LEN,
            FOR_LOOP,
            NUM_STAGES,
            SLOTS,
            KV_FP8,
        )
        if HAS_EXTRA:
            m_i, l_i, acc = _attend_blocks(
                q_main,
                q_tail,
                m_i,
                l_i,
                acc,
                extra_cache,
                extra_sel,
                req,
                sq,
                tl.maximum(blk0, n_main) - n_main,
                blk1 - n_main,
                scale_log2,
                EXTRA_ADDR,
                IS_V32,
                D_MAIN,
                D_NOPE,
                D_TAIL,
                TILE,
                MAIN_TILES,
                NUM_TILES,
                BLOCK_N,
                SCHED_BLOCK,
                DOT_DTYPE,
                DOT_PREC,
                FP8_HW,
                HAS_EXTRA_LEN,
                FOR_LOOP,
                NUM_STAGES,
                SLOTS,
                KV_FP8,
            )

        if n_splits <= 1:
            o, lse_v = final_out_lse(acc, l_i, m_i, sink_log2, HAS_SINK)
            optr = out_ptr + req.to(tl.int64) * stride_ob + sq64 * stride_os + h64[:, None] * stride_oh + cm[None, :]
            tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
            tl.store(lse_ptr + req.to(tl.int64) * stride_lb + h64 * stride_lh + sq64 * stride_ls, lse_v, mask=hmask)
        else:
            lonely = l_i == 0.0
            l_safe = tl.where(lonely, 1.0, l_i)
            lse2 = tl.where(lonely, float("-inf"), tl.log2(l_safe) + tl.where(lonely, 0.0, m_i))
            row = (split_base + split).to(tl.int64)
            aptr = oacc_ptr + row * stride_ar + sq64 * stride_as + h64[:, None] * stride_ah + cm[None, :]
            tl.store(aptr, acc / l_safe[:, None], mask=hmask[:, None])
            tl.store(lacc_ptr + row * stride_lr + sq64 * stride_lsq + h64, lse2, mask=hmask)
        req += 1


def _sel_args(indices: torch.Tensor, lengths: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    return (indices, *indices.stride(), indices.shape[2], lengths if lengths is not None else dummy)


def _keys_args(p: DecodeProblem, is_v32: bool, dummy: torch.Tensor) -> tuple[tuple, int, tuple]:
    """``(cache, ADDR, sel)`` of the main cache: the indices' slots (sparse), or the positions
    ``0 .. cache_seqlens - 1`` through the block table (dense; ``cache_seqlens`` is ``topk_length``
    and ``max_blocks * page_block_size`` plays ``topk``)."""
    cache, addr = cache_args(p.k_cache, is_v32) if p.fp8_cache else (row_cache_args(p.k_cache), 0)
    if not p.is_dense:
        return cache, addr, _sel_args(p.indices, p.topk_length, dummy)
    bt, pbs = p.block_table, cache[4]
    back = p.q.shape[1] - 1 if p.causal else 0
    return cache, addr, (bt, bt.stride(0), back, bt.stride(1), bt.shape[1] * pbs, p.topk_length)


DEFAULT_CONFIG = PortableConfig()  # frozen: one validated instance serves every default call


def launch(
    p: DecodeProblem,
    table: ScheduleTable,
    config: PortableConfig | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the portable split-KV kernel, and the combine kernel when some batch is split.

    Args:
        p: a validated, non-empty problem (:func:`sparse_mla.decode.problem.validate_sparse_decode`,
            or for the dense decode :func:`~sparse_mla.decode.problem.validate_dense_decode`).
        table: its schedule on ``p.q``'s device, sized for this backend's tile.
        config: launch parameters (default :class:`PortableConfig`).
        workspace: ``(o_accum, lse_accum)`` of at least ``table.num_acc_rows`` rows
            (:func:`.workspace.split_accumulators`), or None to allocate them.

    Returns:
        ``out [b, s_q, h_q, 512]`` in q's dtype, ``lse [b, h_q, s_q]`` fp32.
    """
    require_runnable(
        _sparse_decode_kernel, p.q.device, final_out_lse, load_paged_rows, paged_positions, paged_block_offset
    )
    config = config or DEFAULT_CONFIG
    q = p.q
    b, s_q, h_q, _ = q.shape
    lay = p.layout
    dev = q.device
    block_h = small_head_tile(h_q)  # the tile the portable backend declared to the scheduler
    interp = interpreting()
    # Triton 3.6's interpreter truncates fp32 -> bf16 instead of rounding to nearest even: there
    # the kernels write fp32 and torch rounds once at the end (compiled kernels write bf16).
    out, lse = output_tensors(p, torch.float32 if interp else q.dtype)
    o_acc, l_acc = workspace or split_accumulators(table.num_acc_rows, s_q, h_q, p.d_v, dev)
    is_v32 = lay.name == "V32"
    dummy_i32 = table.acc_rows
    cache, addr, sel = _keys_args(p, is_v32, dummy_i32)
    has_extra = p.extra_k_cache is not None
    extra_cache, extra_addr = cache_args(p.extra_k_cache, is_v32) if has_extra else (cache, addr)
    extra_sel = _sel_args(p.extra_indices, p.extra_topk_length, dummy_i32) if has_extra else sel
    args = (
        (q, q.stride(0), q.stride(1), q.stride(2)),
        cache,
        sel,
        extra_cache,
        extra_sel,
        p.attn_sink if p.attn_sink is not None else l_acc,
        (table.metadata, table.acc_rows, table.main_blocks, table.num_blocks_t),
        (out, out.stride(0), out.stride(1), out.stride(2)),
        (lse, lse.stride(0), lse.stride(1), lse.stride(2)),
        (o_acc, o_acc.stride(0), o_acc.stride(1), o_acc.stride(2)),
        (l_acc, l_acc.stride(0), l_acc.stride(1)),
        h_q,
        p.sm_scale * LOG2E,
    )
    consts = dict(
        ADDR=addr,
        EXTRA_ADDR=extra_addr,
        IS_V32=is_v32,
        D_MAIN=512,
        D_TAIL=64,
        **gather_consts(lay),
        BLOCK_H=block_h,
        BLOCK_N=config.block_n,
        SCHED_BLOCK=TOPK_BLOCK_SIZE,
        HAS_TOPK_LEN=p.topk_length is not None,
        HAS_EXTRA=has_extra,
        HAS_EXTRA_LEN=p.extra_topk_length is not None,
        HAS_SINK=p.attn_sink is not None,
        SLOTS=block_table_slots(p.k_cache.shape[1]) if p.is_dense else SLOTS_INDICES.value,
        KV_FP8=p.fp8_cache,
        **dot_consts(device_target(dev)),
        WAIT_PRIOR=table.decode_waits_for_it(dev),  # overlap this launch with the schedule kernel
    )
    if not interp and q.dtype == torch.float16:
        consts["DOT_DTYPE"] = tl.float16  # fp16 rows of the dense decode (FP8 caches take bf16 queries)
    launch_fitting(
        _sparse_decode_kernel,
        (table.num_sm_parts, s_q, cdiv(h_q, block_h)),
        args,
        consts,
        config.num_warps,
        config.num_stages,
        (dev, tuple(consts.items())),
        shrink=("BLOCK_N", 16),  # ~100 KB of shared memory (sm_86/89/120): 32 or 16 tokens a step
        options={"launch_pdl": True} if consts["WAIT_PRIOR"] else None,
    )
    if table.any_split:
        combine_fwd(
            o_acc,
            l_acc,
            table.acc_rows,
            out,
            lse,
            p.attn_sink,
            max_pieces=table.max_pieces,
            split_list=table.split_list,
        )
    return finish_outputs(p, out, lse)
