"""Portable split-KV dense MLA decode in Triton ``tl`` (``flash_mla_with_kvcache`` without
``indices``) and its launcher: any GPU Triton supports, and the CPU under Triton's interpreter.
Twin: :func:`sparse_mla.decode.reference.dense_decode_reference`.

The dense decode is the sparse one whose list of request ``i`` is its context positions
``0 .. cache_seqlens[i] - 1``, turned into cache slots through its block-table row instead of read
from an ``indices`` tensor. Everything but the gather is the sparse decode's: the schedule made on
the device from the lengths (:mod:`.schedule`, ``cache_seqlens`` in the place of ``topk_length``),
the split rows of the workspace, :func:`.combine.final_out_lse` and the combine kernel, the launch
parameters (:class:`.portable.PortableConfig`). One program serves one scheduler partition, one
query token and ``BLOCK_H`` heads, as :mod:`.portable`'s.

The gather (:mod:`sparse_mla.formats.gather`): an FP8 cache (V32 or MODEL1 records) through
``load_block_keys`` with ``SLOTS_BLOCK_TABLE``; a bf16/fp16 cache ``[num_blocks, pbs, 1, d_qk]``
through ``load_paged_rows``. Positions past a request's length (for ``causal``, past the query
token's own position ``len - s_q + sq``) and block-table entries outside the cache are never
loaded (masked loads, 0 as the fill value), so NaN in unattended slots cannot reach the output.

Compiled, the dots take bf16 operands (fp16 for fp16 inputs) with fp32 accumulation and P rounded
to the operand dtype before P·V; under the interpreter fp32 operands with exact products, and the
output is written in fp32 and rounded once by torch (the interpreter truncates fp32 -> bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.env import LOG2E, cdiv, interpreting, require_runnable
from ...core.launcher import launch_fitting
from ...core.target import device_target
from ...formats.gather import (
    SLOTS_BLOCK_TABLE,
    cache_args,
    dot_consts,
    gather_consts,
    load_block_keys,
    load_paged_rows,
    paged_positions,
)
from ..problem import DecodeProblem, finish_outputs, output_tensors
from ..scheduler import TOPK_BLOCK_SIZE, ScheduleTable, small_head_tile
from ..workspace import split_accumulators
from .combine import combine_fwd, final_out_lse
from .portable import DEFAULT_CONFIG, PortableConfig

__all__ = ["launch"]


@triton.jit
def _dense_step(
    q_main,
    q_tail,
    m_i,
    l_i,
    acc,
    cache,
    sel,
    req,
    sq,
    pos0,
    n_valid,
    scale_log2,
    KV_FP8: tl.constexpr,
    ADDR: tl.constexpr,
    IS_V32: tl.constexpr,
    D_NOPE: tl.constexpr,
    TILE: tl.constexpr,
    MAIN_TILES: tl.constexpr,
    NUM_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FP8_HW: tl.constexpr,
    RESCALE_TAU: tl.constexpr = 8.0,
):
    """One BLOCK_N-position step of the online softmax (the sparse kernel's step, same numerics);
    returns the updated (m, l, acc)."""
    if KV_FP8:
        k_main, k_tail, valid = load_block_keys(
            cache,
            sel,
            req,
            sq,
            pos0,
            n_valid,
            ADDR,
            IS_V32,
            512,
            D_NOPE,
            64,
            TILE,
            MAIN_TILES,
            NUM_TILES,
            BLOCK_N,
            DOT_DTYPE,
            FP8_HW,
            SLOTS_BLOCK_TABLE,
        )
    else:
        k_main, k_tail, valid = load_paged_rows(cache, sel, req, sq, pos0, n_valid, IS_V32, BLOCK_N, DOT_DTYPE)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PREC)
    if IS_V32:
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=DOT_PREC)
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    # the running max moves only when a block's max exceeds it by more than RESCALE_TAU (log2
    # units): P stays <= 2^RESCALE_TAU, and alpha is 1 in most steps (NaN > tau is False)
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
def _dense_decode_kernel(
    q,
    cache,
    sel,
    sched,
    out,
    lse,
    o_acc,
    lse_acc,
    h_q,
    scale_log2,
    KV_FP8: tl.constexpr,
    ADDR: tl.constexpr,
    IS_V32: tl.constexpr,
    D_NOPE: tl.constexpr,
    TILE: tl.constexpr,
    MAIN_TILES: tl.constexpr,
    NUM_TILES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCHED_BLOCK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FP8_HW: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Grid ``(num_sm_parts, s_q, ceil(h_q / BLOCK_H))``; the tuples as in :mod:`.portable`'s
    kernel, with ``sel = (block_table, stride_b, causal_back, stride_col, max_blocks, cache_seqlens)``
    (:func:`sparse_mla.formats.gather.paged_positions`)."""
    q_ptr, stride_qb, stride_qs, stride_qh = q
    meta_ptr, nsplit_ptr, mainblk_ptr, nblk_ptr = sched
    out_ptr, stride_ob, stride_os, stride_oh = out
    lse_ptr, stride_lb, stride_lh, stride_ls = lse
    oacc_ptr, stride_ar, stride_as, stride_ah = o_acc
    lacc_ptr, stride_lr, stride_lsq = lse_acc
    _bt, _sbb, _back, _sbc, max_blocks, len_ptr = sel
    _kv, _sblk, _stok, _ntok, pbs, _pbs_log2 = cache
    cap = max_blocks * pbs
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
    cm = tl.arange(0, 512)
    ct = tl.arange(0, 64)
    no_sink = tl.zeros([BLOCK_H], tl.float32)

    req = begin_req
    while req <= end_req:
        blk0 = tl.where(req == begin_req, begin_block, 0)
        blk1 = tl.minimum(tl.where(req == end_req, end_block, tl.load(nblk_ptr + req)), tl.load(mainblk_ptr + req))
        split = tl.where(req == begin_req, begin_split, 0)
        split_base = tl.load(nsplit_ptr + req)
        n_splits = tl.load(nsplit_ptr + req + 1) - split_base
        n_valid = tl.minimum(tl.maximum(tl.load(len_ptr + req), 0), cap)

        qrow = q_ptr + req.to(tl.int64) * stride_qb + sq * stride_qs + heads.to(tl.int64)[:, None] * stride_qh
        q_main = tl.load(qrow + cm[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        if IS_V32:
            q_tail = tl.load(qrow + 512 + ct[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        else:
            q_tail = tl.zeros([BLOCK_H, 64], dtype=DOT_DTYPE)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, 512], tl.float32)
        sub_begin = blk0 * (SCHED_BLOCK // BLOCK_N)
        sub_end = blk1 * (SCHED_BLOCK // BLOCK_N)
        if FOR_LOOP:
            for blk_i in tl.range(sub_begin, sub_end, num_stages=NUM_STAGES):
                m_i, l_i, acc = _dense_step(
                    q_main, q_tail, m_i, l_i, acc, cache, sel, req, sq, blk_i * BLOCK_N, n_valid, scale_log2,
                    KV_FP8, ADDR, IS_V32, D_NOPE, TILE, MAIN_TILES, NUM_TILES, BLOCK_N, DOT_DTYPE, DOT_PREC, FP8_HW,
                )  # fmt: skip
        else:  # interpreter (its range() cannot take loaded bounds with NumPy >= 2.4)
            blk_i = sub_begin
            while blk_i < sub_end:
                m_i, l_i, acc = _dense_step(
                    q_main, q_tail, m_i, l_i, acc, cache, sel, req, sq, blk_i * BLOCK_N, n_valid, scale_log2,
                    KV_FP8, ADDR, IS_V32, D_NOPE, TILE, MAIN_TILES, NUM_TILES, BLOCK_N, DOT_DTYPE, DOT_PREC, FP8_HW,
                )  # fmt: skip
                blk_i += 1

        if n_splits <= 1:
            o, lse_v = final_out_lse(acc, l_i, m_i, no_sink, False)
            optr = out_ptr + req.to(tl.int64) * stride_ob + sq * stride_os + heads[:, None] * stride_oh + cm[None, :]
            tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
            tl.store(lse_ptr + req.to(tl.int64) * stride_lb + heads * stride_lh + sq * stride_ls, lse_v, mask=hmask)
        else:
            lonely = l_i == 0.0
            l_safe = tl.where(lonely, 1.0, l_i)
            lse2 = tl.where(lonely, float("-inf"), tl.log2(l_safe) + tl.where(lonely, 0.0, m_i))
            row = (split_base + split).to(tl.int64)
            aptr = oacc_ptr + row * stride_ar + sq * stride_as + heads[:, None] * stride_ah + cm[None, :]
            tl.store(aptr, acc / l_safe[:, None], mask=hmask[:, None])
            tl.store(lacc_ptr + row * stride_lr + sq * stride_lsq + heads, lse2, mask=hmask)
        req += 1


def _row_cache_args(kc: torch.Tensor) -> tuple:
    """The kernel's ``cache`` tuple for a bf16/fp16 cache ``[num_blocks, pbs, 1, d_qk]`` (strides in elements)."""
    nb, pbs = kc.shape[0], kc.shape[1]
    return (kc, kc.stride(0), kc.stride(1), nb * pbs, pbs, 0)


def launch(
    p: DecodeProblem,
    table: ScheduleTable,
    config: PortableConfig | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the dense split-KV kernel, and the combine kernel when some request is split.

    Args:
        p: a validated, non-empty dense problem (:func:`sparse_mla.decode.problem.validate_dense_decode`).
        table: its schedule (made from ``cache_seqlens``) on ``p.q``'s device, sized for this backend's tile.
        config: launch parameters (default :class:`.portable.PortableConfig`).
        workspace: ``(o_accum, lse_accum)`` of at least ``table.num_acc_rows`` rows, or None to allocate them.

    Returns:
        ``out [b, s_q, h_q, 512]`` in q's dtype, ``lse [b, h_q, s_q]`` fp32.
    """
    require_runnable(_dense_decode_kernel, p.q.device, final_out_lse, load_block_keys, load_paged_rows, paged_positions)
    config = config or DEFAULT_CONFIG
    q = p.q
    b, s_q, h_q, d_qk = q.shape
    dev = q.device
    block_h = small_head_tile(h_q)
    interp = interpreting()
    out, lse = output_tensors(p, torch.float32 if interp else q.dtype)
    o_acc, l_acc = workspace or split_accumulators(table.num_acc_rows, s_q, h_q, p.d_v, dev)
    is_v32 = d_qk == 576
    kv_fp8 = p.fp8_cache
    if kv_fp8:
        cache, addr = cache_args(p.k_cache, is_v32)
    else:
        cache, addr = _row_cache_args(p.k_cache), 0
    bt = p.block_table
    sel = (bt, bt.stride(0), s_q - 1 if p.causal else 0, bt.stride(1), bt.shape[1], p.topk_length)
    args = (
        (q, q.stride(0), q.stride(1), q.stride(2)),
        cache,
        sel,
        (table.metadata, table.acc_rows, table.main_blocks, table.num_blocks_t),
        (out, out.stride(0), out.stride(1), out.stride(2)),
        (lse, lse.stride(0), lse.stride(1), lse.stride(2)),
        (o_acc, o_acc.stride(0), o_acc.stride(1), o_acc.stride(2)),
        (l_acc, l_acc.stride(0), l_acc.stride(1)),
        h_q,
        p.sm_scale * LOG2E,
    )
    dots = dot_consts(device_target(dev))
    if not interp and q.dtype == torch.float16:
        dots["DOT_DTYPE"] = tl.float16  # fp16 rows (the FP8 path takes bf16 queries only)
    consts = dict(
        KV_FP8=kv_fp8,
        ADDR=addr,
        IS_V32=is_v32,
        **gather_consts(p.layout),
        BLOCK_H=block_h,
        BLOCK_N=config.block_n,
        SCHED_BLOCK=TOPK_BLOCK_SIZE,
        **dots,
    )
    launch_fitting(
        _dense_decode_kernel,
        (table.num_sm_parts, s_q, cdiv(h_q, block_h)),
        args,
        consts,
        config.num_warps,
        config.num_stages,
        (dev, tuple(consts.items())),
        shrink=("BLOCK_N", 16),
    )
    if table.any_split:
        combine_fwd(o_acc, l_acc, table.acc_rows, out, lse, None, max_pieces=table.max_pieces)
    return finish_outputs(p, out, lse)
