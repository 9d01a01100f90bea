"""Triton ``tl`` kernels of the indexer and their launchers (any GPU Triton supports; the CPU
under the interpreter). Twins: :mod:`sparse_mla.indexer.reference`. Imported on first use."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from ..core.checks import check_apart, check_no_self_overlap
from ..core.env import cdiv, cuda_num_sms, interpreting, next_pow2, pdl_enabled, require_runnable
from ..core.fp8 import ceil_log2_div448, e4m3_decode_exact, e4m3_rtne_bits
from ..core.launcher import launch as launch_kernel
from ..core.paging import slot_records, table_slots
from .problem import check_tensor_arg, index_cache_geometry

__all__ = ["launch_quant_store", "launch_mqa_logits", "launch_paged_mqa_logits", "launch_topk"]


@triton.jit
def _index_quant_store_kernel(
    k_ptr,
    stride_k,
    slot_ptr,
    stride_slot,
    cache_ptr,
    stride_blk,
    bs,
    num_slots,
    n,
    D: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    toks, valid, off, base = slot_records(slot_ptr, stride_slot, n, num_slots, bs, stride_blk, BLOCK_T)
    cols = tl.arange(0, D)
    x = tl.load(k_ptr + toks.to(tl.int64)[:, None] * stride_k + cols[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    if UE8M0:
        e = ceil_log2_div448(amax)  # scale 2^e
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        y = x * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # x / 2^e, exact
    else:
        scale = tl.math.div_rn(amax, 448.0)
        y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    q8 = e4m3_rtne_bits(y)
    # a key with a NaN or inf value is stored as NaN (bytes 0x7F, scale NaN), as the twin does
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1) > 0
    q8 = tl.where(bad[:, None], 0x7F, q8).to(tl.uint8)
    scale = tl.where(bad, float("nan"), scale)
    tl.store(cache_ptr + base[:, None] + off[:, None] * D + cols[None, :], q8, mask=valid[:, None])
    sptr = (cache_ptr + base + bs * D + off * 4).to(tl.pointer_type(tl.float32))
    tl.store(sptr, scale, mask=valid)


def launch_quant_store(
    k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, d: int, ue8m0: bool
) -> None:
    require_runnable(_index_quant_store_kernel, kv_cache.device, e4m3_rtne_bits, ceil_log2_div448, slot_records)
    nb, bs, _, stride_blk = index_cache_geometry(kv_cache)
    n = k.shape[0]
    block_t = 16
    _index_quant_store_kernel[(cdiv(n, block_t),)](
        k, k.stride(0), slot_mapping, slot_mapping.stride(0), kv_cache, stride_blk, bs, nb * bs, n,
        D=d, UE8M0=ue8m0, BLOCK_T=block_t,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ logits
#
# Both logits kernels compute a tile as ``S = K @ Q^T`` with the keys as the M side (BLOCK_N tokens,
# a [tokens, D] tile, D contiguous) and the query rows of one program (positions x heads, D
# contiguous) as the N side: both operands K-major, which Hopper's FP8 wgmma needs. The sum over
# heads is then a sum along the accumulator's columns (in-thread adds and a few lane shuffles, no
# shared memory), the key scale is per accumulator row and the head weight per column.
# On sm_89+ (and in the interpreter) the operands are float8e4nv with fp32 accumulation; on older
# GPUs (no e4m3 type) the bytes are decoded to fp16 by integer operations (exact) and the dot is
# fp16 x fp16 -> fp32.


@triton.jit
def _e4m3_operand(ptrs, mask, FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Load e4m3 bytes at uint8 ``ptrs`` as a dot operand: float8e4nv itself (``FP8_DOT``), else
    decoded to ``DOT_DTYPE`` without the e4m3 type (sign and 7 low bits placed into an fp16, times
    2^8; 0x7F / 0xFF are NaN): the same values."""
    if FP8_DOT:
        return tl.load(ptrs.to(tl.pointer_type(tl.float8e4nv)), mask=mask, other=0.0)
    else:
        return e4m3_decode_exact(tl.load(ptrs, mask=mask, other=0)).to(DOT_DTYPE)


@triton.jit
def _head_sum(s, sc, w, hv, BLOCK_N: tl.constexpr, P: tl.constexpr, H_P2: tl.constexpr, HEAD_PAD: tl.constexpr):
    """``s [BLOCK_N, P * H_P2]`` key-by-row scores of the unscaled keys, ``sc [BLOCK_N]`` key scales,
    ``w [P * H_P2]`` row weights -> ``[BLOCK_N, P]``: ``sc[j] · Σ_h w[p, h] · relu(s[j, (p, h)])``,
    the model's order (DeepSeek-V3.2's formula; DeepGEMM's): the scale multiplies each key's sum once, so a score
    costs a relu and a fused multiply-add (NaN propagates, as in the twin). ``HEAD_PAD`` (H < H_P2):
    the rows past H (``hv`` false) add nothing."""
    t = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
    if HEAD_PAD:
        t = tl.where(hv[None, :], t, 0.0)
    return tl.sum(tl.reshape(t, [BLOCK_N, P, H_P2]), axis=2) * sc[:, None]


@triton.jit
def _mqa_tile(
    t, q_t, w, hv, ks, ke, rows, rmask, kv_ptr, stride_kv, scale_ptr, out_ptr, stride_os, s_kv,
    D: tl.constexpr, BQ: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """Key tile ``t`` against the program's ``BQ`` query tokens: logits (or -inf) stored."""
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < s_kv
    dd = tl.arange(0, D)
    k = _e4m3_operand(kv_ptr + cols.to(tl.int64)[:, None] * stride_kv + dd[None, :], cmask[:, None], FP8_DOT, DOT_DTYPE)
    sc = tl.load(scale_ptr + cols, mask=cmask, other=0.0)
    s = tl.dot(k, q_t, input_precision=DOT_PREC)
    lg = _head_sum(s, sc, w, hv, BLOCK_N, BQ, H_P2, HEAD_PAD)
    inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :]) & cmask[:, None]
    lg = tl.where(inside, lg, float("-inf"))
    optr = out_ptr + rows.to(tl.int64)[None, :] * stride_os + cols[:, None]
    tl.store(optr, lg, mask=rmask[None, :] & cmask[:, None])


@triton.jit
def _fill_tile(t, out_rows, row_mask, n_cols, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """-inf into columns ``[t * BLOCK_N, (t + 1) * BLOCK_N) ∩ [0, n_cols)`` of ``R`` rows
    (``out_rows [R]`` row pointers)."""
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    val = tl.full([BLOCK_N, R], float("-inf"), tl.float32)
    tl.store(out_rows[None, :] + cols[:, None], val, mask=row_mask[None, :] & (cols[:, None] < n_cols))


@triton.jit
def _mqa_logits_kernel(
    q_ptr, stride_qs, stride_qh, kv_ptr, stride_kv, scale_ptr, w_ptr, stride_ws, stride_wh, ks_ptr, ke_ptr,
    out_ptr, stride_os, s_q, s_kv, H, tiles_per_prog,
    D: tl.constexpr, BQ: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    FOR_LOOP: tl.constexpr, NUM_STAGES: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """Grid ``(ceil(s_q / BQ), splits)``: ``BQ`` query tokens (``BQ * H_P2`` dot rows, loaded once)
    against key tiles ``[pid1 * tiles_per_prog, ...)``, BLOCK_N keys a step; tiles outside every
    row's ``[ks, ke)`` are not computed, only filled with -inf."""
    rows = tl.program_id(0) * BQ + tl.arange(0, BQ)
    rmask = rows < s_q
    ks = tl.load(ks_ptr + rows, mask=rmask, other=0)
    ke = tl.load(ke_ptr + rows, mask=rmask, other=0)
    live = rmask & (ke > ks)
    lo = tl.maximum(tl.min(tl.where(live, ks, s_kv), axis=0), 0)
    hi = tl.minimum(tl.max(tl.where(live, ke, 0), axis=0), s_kv)
    hh = tl.arange(0, H_P2)
    dd = tl.arange(0, D)
    qm = rmask[:, None] & (hh[None, :] < H)
    qoff = tl.reshape(rows.to(tl.int64)[:, None] * stride_qs + hh[None, :] * stride_qh, [BQ * H_P2])
    qm1 = tl.reshape(qm, [BQ * H_P2])
    q = _e4m3_operand(q_ptr + qoff[:, None] + dd[None, :], qm1[:, None], FP8_DOT, DOT_DTYPE)
    q_t = tl.trans(q)
    woff = rows.to(tl.int64)[:, None] * stride_ws + hh[None, :] * stride_wh
    w = tl.reshape(tl.load(w_ptr + woff, mask=qm, other=0.0), [BQ * H_P2])
    n_tiles = tl.cdiv(s_kv, BLOCK_N)
    t_lo = tl.program_id(1) * tiles_per_prog
    t_hi = tl.minimum(t_lo + tiles_per_prog, n_tiles)
    c_lo = tl.minimum(tl.maximum(lo // BLOCK_N, t_lo), t_hi)
    c_hi = tl.minimum(tl.maximum(tl.cdiv(hi, BLOCK_N), c_lo), t_hi)
    out_rows = out_ptr + rows.to(tl.int64) * stride_os
    if FOR_LOOP:
        for t in tl.range(t_lo, c_lo):
            _fill_tile(t, out_rows, rmask, s_kv, BQ, BLOCK_N)
        for t in tl.range(c_lo, c_hi, num_stages=NUM_STAGES):
            _mqa_tile(t, q_t, w, qm1, ks, ke, rows, rmask, kv_ptr, stride_kv, scale_ptr, out_ptr, stride_os, s_kv,
                      D, BQ, H_P2, BLOCK_N, FP8_DOT, DOT_DTYPE, DOT_PREC, HEAD_PAD)  # fmt: skip
        for t in tl.range(c_hi, t_hi):
            _fill_tile(t, out_rows, rmask, s_kv, BQ, BLOCK_N)
    else:  # the interpreter: range() cannot take loaded bounds (NumPy >= 2.4)
        t = t_lo
        while t < c_lo:
            _fill_tile(t, out_rows, rmask, s_kv, BQ, BLOCK_N)
            t += 1
        while t < c_hi:
            _mqa_tile(t, q_t, w, qm1, ks, ke, rows, rmask, kv_ptr, stride_kv, scale_ptr, out_ptr, stride_os, s_kv,
                      D, BQ, H_P2, BLOCK_N, FP8_DOT, DOT_DTYPE, DOT_PREC, HEAD_PAD)  # fmt: skip
            t += 1
        while t < t_hi:
            _fill_tile(t, out_rows, rmask, s_kv, BQ, BLOCK_N)
            t += 1


@triton.jit
def _paged_tile(
    t, ctx, q_t, w, hv, pp, bt_row, max_blocks, cache_ptr, stride_blk, bs, nb, out_rows, row_mask, max_ctx, next_n,
    D: tl.constexpr, P: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """Keys ``[t * BLOCK_N, (t + 1) * BLOCK_N)`` of one request (through its block-table row
    ``bt_row``) against its ``P`` query positions ``pp``: logits (or -inf) stored."""
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    page = cols // bs
    pmask = (cols < ctx) & (page < max_blocks)
    blk = tl.load(bt_row + page, mask=pmask, other=-1)
    okk = pmask & (blk >= 0) & (blk < nb)
    base = tl.where(okk, blk, 0).to(tl.int64) * stride_blk
    off = (cols - page * bs).to(tl.int64)
    dd = tl.arange(0, D)
    k = _e4m3_operand(cache_ptr + base[:, None] + off[:, None] * D + dd[None, :], okk[:, None], FP8_DOT, DOT_DTYPE)
    sc = tl.load((cache_ptr + base + bs * D + off * 4).to(tl.pointer_type(tl.float32)), mask=okk, other=0.0)
    s = tl.dot(k, q_t, input_precision=DOT_PREC)
    lg = _head_sum(s, sc, w, hv, BLOCK_N, P, H_P2, HEAD_PAD)
    visible = okk[:, None] & (cols[:, None] <= ctx - next_n + pp[None, :])
    lg = tl.where(visible, lg, float("-inf"))
    tl.store(out_rows[None, :] + cols[:, None], lg, mask=row_mask[None, :] & (cols[:, None] < max_ctx))


@triton.jit
def _paged_program(
    q_ptr, stride_qb, stride_qn, stride_qh, w_ptr, stride_wr, stride_wh, ctx_ptr, bt_ptr, stride_btb, out_ptr,
    stride_or, max_ctx, next_n, H, tiles_per_prog,
    D: tl.constexpr, P: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """What a paged-logits program of grid ``(b, chunks, ceil(next_n / P))`` works on: request
    ``pid0``'s context length, its query positions ``pp`` (``[pid2 * P, ...)``), the ``P * H_P2``
    query rows (``qm1`` live) as the dot's ``Qᵀ``, their weights, output rows and row mask, the
    block-table row, and the key tiles ``[t_lo, t_mid)`` inside the context and ``[t_mid, t_hi)``
    past it (-inf only)."""
    i = tl.program_id(0)
    ctx = tl.load(ctx_ptr + i)
    pp = tl.program_id(2) * P + tl.arange(0, P)
    hh = tl.arange(0, H_P2)
    dd = tl.arange(0, D)
    qm = (pp[:, None] < next_n) & (hh[None, :] < H)
    qoff = tl.reshape(pp[:, None] * stride_qn + hh[None, :] * stride_qh, [P * H_P2])
    qm1 = tl.reshape(qm, [P * H_P2])
    q = _e4m3_operand(
        q_ptr + i.to(tl.int64) * stride_qb + qoff[:, None] + dd[None, :], qm1[:, None], FP8_DOT, DOT_DTYPE
    )
    q_t = tl.trans(q)
    orow = (i * next_n + pp).to(tl.int64)
    w = tl.reshape(tl.load(w_ptr + orow[:, None] * stride_wr + hh[None, :] * stride_wh, mask=qm, other=0.0), [P * H_P2])
    out_rows = out_ptr + orow * stride_or
    row_mask = pp < next_n
    bt_row = bt_ptr + i.to(tl.int64) * stride_btb
    n_tiles = tl.cdiv(max_ctx, BLOCK_N)
    t_lo = tl.program_id(1) * tiles_per_prog
    t_hi = tl.minimum(t_lo + tiles_per_prog, n_tiles)
    # ceil(ctx / BLOCK_N) without ctx + BLOCK_N - 1 (overflows int32 near 2^31); int32 keeps the loop
    # counter 32-bit (an int64 bound cost 28 registers and made every tile index int64)
    ctx_tiles = ctx // BLOCK_N + (ctx % BLOCK_N != 0).to(tl.int32)
    t_mid = tl.maximum(tl.minimum(t_hi, ctx_tiles), t_lo)
    return ctx, pp, qm1, q_t, w, out_rows, row_mask, bt_row, t_lo, t_mid, t_hi


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr, stride_qb, stride_qn, stride_qh, cache_ptr, stride_blk, bs, nb, w_ptr, stride_wr, stride_wh,
    ctx_ptr, bt_ptr, stride_btb, max_blocks, out_ptr, stride_or, max_ctx, next_n, H, tiles_per_prog,
    D: tl.constexpr, P: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    FOR_LOOP: tl.constexpr, NUM_STAGES: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """Grid ``(b, chunks, ceil(next_n / P))``: request ``pid0``'s query positions ``[pid2 * P, ...)``
    (``P * H_P2`` dot rows, loaded once) against its key tiles ``[pid1 * tiles_per_prog, ...)``,
    BLOCK_N keys a step (each key read once per request when ``P >= next_n``), the next tiles'
    gathers in flight (``NUM_STAGES``); tiles past the context only filled with -inf."""
    ctx, pp, qm1, q_t, w, out_rows, row_mask, bt_row, t_lo, t_mid, t_hi = _paged_program(
        q_ptr, stride_qb, stride_qn, stride_qh, w_ptr, stride_wr, stride_wh, ctx_ptr, bt_ptr, stride_btb, out_ptr,
        stride_or, max_ctx, next_n, H, tiles_per_prog, D, P, H_P2, BLOCK_N, FP8_DOT, DOT_DTYPE,
    )  # fmt: skip
    if FOR_LOOP:
        for t in tl.range(t_lo, t_mid, num_stages=NUM_STAGES):
            _paged_tile(t, ctx, q_t, w, qm1, pp, bt_row, max_blocks, cache_ptr, stride_blk, bs, nb, out_rows, row_mask,
                        max_ctx, next_n, D, P, H_P2, BLOCK_N, FP8_DOT, DOT_DTYPE, DOT_PREC, HEAD_PAD)  # fmt: skip
        for t in tl.range(t_mid, t_hi):
            _fill_tile(t, out_rows, row_mask, max_ctx, P, BLOCK_N)
    else:  # the interpreter: range() cannot take loaded bounds (NumPy >= 2.4)
        t = t_lo
        while t < t_mid:
            _paged_tile(t, ctx, q_t, w, qm1, pp, bt_row, max_blocks, cache_ptr, stride_blk, bs, nb, out_rows, row_mask,
                        max_ctx, next_n, D, P, H_P2, BLOCK_N, FP8_DOT, DOT_DTYPE, DOT_PREC, HEAD_PAD)  # fmt: skip
            t += 1
        while t < t_hi:
            _fill_tile(t, out_rows, row_mask, max_ctx, P, BLOCK_N)
            t += 1


@triton.jit
def _paged_tma_tile(
    t, ctx, q_t, w, hv, pp, bt_row, max_blocks, k_desc, s_desc, bs, nb, out_rows, row_mask, max_ctx, next_n,
    D: tl.constexpr, P: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """``_paged_tile`` with the keys and scales brought by the tensor-memory accelerator: keys
    ``[t * BLOCK_N, (t + 1) * BLOCK_N)`` lie in one page (``bs % BLOCK_N == 0``), so one box
    ``[1, BLOCK_N, D]`` of the page's key bytes and one ``[1, BLOCK_N]`` of its scales; a block id
    outside ``[0, nb)`` reads zeros (the copy clips) and its logits are -inf."""
    tok0 = t * BLOCK_N
    page = tok0 // bs
    blk = tl.load(bt_row + page, mask=page < max_blocks, other=-1)
    off = tok0 - page * bs
    ok = (page < max_blocks) & (blk >= 0) & (blk < nb)
    k = tl.reshape(k_desc.load([blk, off, 0]), [BLOCK_N, D])
    sc = tl.reshape(s_desc.load([blk, off]), [BLOCK_N])
    s = tl.dot(k, q_t)
    lg = _head_sum(s, sc, w, hv, BLOCK_N, P, H_P2, HEAD_PAD)
    cols = tok0 + tl.arange(0, BLOCK_N)
    visible = ok & (cols[:, None] < ctx) & (cols[:, None] <= ctx - next_n + pp[None, :])
    lg = tl.where(visible, lg, float("-inf"))
    tl.store(out_rows[None, :] + cols[:, None], lg, mask=row_mask[None, :] & (cols[:, None] < max_ctx))


@triton.jit
def _paged_tma_logits_kernel(
    q_ptr, stride_qb, stride_qn, stride_qh, k_desc, s_desc, bs, nb, w_ptr, stride_wr, stride_wh,
    ctx_ptr, bt_ptr, stride_btb, max_blocks, out_ptr, stride_or, max_ctx, next_n, H, tiles_per_prog,
    D: tl.constexpr, P: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    FOR_LOOP: tl.constexpr, NUM_STAGES: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """``_paged_mqa_logits_kernel`` on Hopper with e4m3 dots and keys brought by tensor-memory
    copies (``_paged_tma_tile``): no address registers, the copies in flight ``NUM_STAGES`` deep."""
    ctx, pp, qm1, q_t, w, out_rows, row_mask, bt_row, t_lo, t_mid, t_hi = _paged_program(
        q_ptr, stride_qb, stride_qn, stride_qh, w_ptr, stride_wr, stride_wh, ctx_ptr, bt_ptr, stride_btb, out_ptr,
        stride_or, max_ctx, next_n, H, tiles_per_prog, D, P, H_P2, BLOCK_N, True, tl.float16,
    )  # fmt: skip
    if FOR_LOOP:
        for t in tl.range(t_lo, t_mid, num_stages=NUM_STAGES):
            _paged_tma_tile(t, ctx, q_t, w, qm1, pp, bt_row, max_blocks, k_desc, s_desc, bs, nb, out_rows, row_mask,
                            max_ctx, next_n, D, P, H_P2, BLOCK_N, HEAD_PAD)  # fmt: skip
        for t in tl.range(t_mid, t_hi):
            _fill_tile(t, out_rows, row_mask, max_ctx, P, BLOCK_N)
    else:  # the interpreter: range() cannot take loaded bounds (NumPy >= 2.4)
        t = t_lo
        while t < t_mid:
            _paged_tma_tile(t, ctx, q_t, w, qm1, pp, bt_row, max_blocks, k_desc, s_desc, bs, nb, out_rows, row_mask,
                            max_ctx, next_n, D, P, H_P2, BLOCK_N, HEAD_PAD)  # fmt: skip
            t += 1
        while t < t_hi:
            _fill_tile(t, out_rows, row_mask, max_ctx, P, BLOCK_N)
            t += 1


#: launch parameters of the logits kernels (the sweep, ``benchmarks/indexer_sweep.py``, overrides them):
#: ``block_n`` keys per step, ``rows`` dot rows per program (query positions or tokens x heads,
#: padded to powers of two), ``progs_per_sm`` programs to aim for per SM (the key range is split
#: until there are that many), ``fp8_dot`` None = by device (sm_89+ and the interpreter). The
#: paged kernel's tensor-memory path (``tma``: None = where the device has it, sm_90+) has its own
#: ``tma_stages`` (copies in flight: about half the stages), ``tma_progs_per_sm`` and
#: ``tma_maxnreg`` (168 registers: 3 programs of 4 warps per SM; measured on the H200, session 9:
#: 219 us against 291 at the compiler's 180 registers and 16 programs per SM)
PREFILL_CONFIG = dict(block_n=128, rows=128, num_warps=8, num_stages=3, progs_per_sm=4, fp8_dot=None)
PAGED_CONFIG = dict(
    block_n=64, rows=256, num_warps=4, num_stages=4, progs_per_sm=16, fp8_dot=None,
    tma=None, tma_stages=8, tma_progs_per_sm=8, tma_maxnreg=168,
)  # fmt: skip


def tma_supported(device: torch.device) -> bool:
    """Whether ``device`` has the tensor-memory accelerator (CUDA sm_90+; not under the interpreter)."""
    if device.type != "cuda" or interpreting() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _paged_descriptors(kv_cache, nb, bs, d, stride_blk, block_n, meta, cfg):
    """``(keys, scales)`` tensor descriptors of the paged kernel's copies, or None where the
    tensor-memory path does not apply: not asked for (``cfg["tma"]`` False; None = where the device
    has it), no e4m3 dots, a tile that would straddle pages (``block_size % block_n``), or a
    start, block stride or scale offset that is not a multiple of 16 bytes (the copies' rule)."""
    want = cfg["tma"]
    if want is None:
        want = tma_supported(kv_cache.device)
    if not want or not meta["FP8_DOT"] or bs % block_n or d > 256:
        return None
    if kv_cache.data_ptr() % 16 or stride_blk % 16 or (bs * d) % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    keys = TensorDescriptor(kv_cache.view(torch.float8_e4m3fn), [nb, bs, d], [stride_blk, d, 1], [1, block_n, d])
    first_scale = kv_cache.as_strided((4,), (1,), kv_cache.storage_offset() + bs * d).view(torch.float32)
    scales = TensorDescriptor(first_scale, [nb, bs], [stride_blk // 4, 1], [1, block_n])
    return keys, scales


def fp8_dot_supported(device: torch.device) -> bool:
    """Whether the logits kernels take e4m3 tensor-core dots on ``device`` by default: compiled on
    CUDA sm_89+ (AMD, older NVIDIA GPUs and the interpreter: the exact integer e4m3 decode)."""
    if device.type != "cuda" or interpreting():
        # the interpreter: Triton 3.6-3.9 read e4m3 NaN bytes as +-480 inside its FP8 dots, so CPU
        # calls take the exact integer decode (tests still run the FP8 path there by asking for it)
        return False
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _dot_meta(device: torch.device, fp8_dot: bool | None, d: int) -> dict:
    interp = interpreting()
    fp8 = fp8_dot_supported(device) if fp8_dot is None else bool(fp8_dot)
    # e4m3 tensor-core dots need K >= 32 (wgmma's k step): head_dim 16 takes the fp16 decode path
    fp8 = fp8 and (interp or d >= 32)
    wide = tl.float32 if interp else tl.float16  # the interpreter's half-precision dots are wrong
    return dict(
        FP8_DOT=fp8,
        DOT_DTYPE=wide,
        DOT_PREC="ieee" if (interp and not fp8) else None,
        FOR_LOOP=not interp,
    )


def _rows_tile(h: int, groups: int, rows: int) -> tuple[int, int]:
    """``(G, H_P2)``: ``G`` groups (query positions or tokens) of ``H_P2`` head rows per program,
    ``G * H_P2 <= max(rows, H_P2)`` and ``>= 16`` (a dot's smallest side)."""
    h_p2 = next_pow2(h)
    g = max(1, min(next_pow2(groups), rows // h_p2))
    if g * h_p2 < 16:
        h_p2 = 16 // g
    return g, h_p2


def _split(n_tiles: int, programs: int, target: int) -> tuple[int, int]:
    """``(tiles_per_prog, splits)``: split ``n_tiles`` into about ``target / programs`` even parts."""
    splits = max(1, min(n_tiles, -(-target // max(programs, 1))))
    per = cdiv(n_tiles, splits)
    return per, cdiv(n_tiles, per)


def _num_sms(device: torch.device, num_sms: int | None) -> int:
    if num_sms is not None:
        return max(1, int(num_sms))
    return cuda_num_sms(device) if device.type == "cuda" else 1


def launch_mqa_logits(q, kv, kv_scale, weights, ks, ke, out, num_sms=None, config=None) -> None:
    """``q [s_q, H, D]`` and ``kv [s_kv, D]`` as uint8 (e4m3 bytes); ``out [s_q, s_kv]`` fp32."""
    require_runnable(_mqa_logits_kernel, q.device, _e4m3_operand, e4m3_decode_exact, _head_sum, _mqa_tile, _fill_tile)
    cfg = {**PREFILL_CONFIG, **(config or {})}
    s_q, h, d = q.shape
    s_kv = kv.shape[0]
    bq, h_p2 = _rows_tile(h, s_q, cfg["rows"])
    block_n = cfg["block_n"]
    n_qb = cdiv(s_q, bq)
    per, splits = _split(cdiv(s_kv, block_n), n_qb, _num_sms(q.device, num_sms) * cfg["progs_per_sm"])
    _mqa_logits_kernel[(n_qb, splits)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), kv_scale, weights, weights.stride(0), weights.stride(1),
        ks, ke, out, out.stride(0), s_q, s_kv, h, per,
        D=d, BQ=bq, H_P2=h_p2, BLOCK_N=block_n, **_dot_meta(q.device, cfg["fp8_dot"], d), HEAD_PAD=h < h_p2,
        NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"],
    )  # fmt: skip


def launch_paged_mqa_logits(
    q, kv_cache, weights, context_lens, block_table, out, max_context_len, num_sms=None, config=None
) -> None:
    """``q [b, next_n, H, D]`` uint8 (e4m3 bytes); ``out [b * next_n, max_context_len]`` fp32;
    ``num_sms`` sizes the grid (default: the device's)."""
    require_runnable(
        _paged_mqa_logits_kernel, q.device, _e4m3_operand, e4m3_decode_exact, _head_sum, _paged_tile, _fill_tile,
        _paged_program, _paged_tma_tile, _paged_tma_logits_kernel,
    )  # fmt: skip
    cfg = {**PAGED_CONFIG, **(config or {})}
    b, next_n, h, d = q.shape
    nb, bs, _, stride_blk = index_cache_geometry(kv_cache)
    p, h_p2 = _rows_tile(h, next_n, cfg["rows"])
    groups = cdiv(next_n, p)
    block_n = cfg["block_n"]
    meta = _dot_meta(q.device, cfg["fp8_dot"], d)
    # more than 128 rows (or 128 fp16 rows: spills on sm_80) take two warpgroups unless told otherwise
    big = p * h_p2 > (128 if meta["FP8_DOT"] else 64)
    warps = cfg["num_warps"] if (config and "num_warps" in config) or not big else 8
    descs = _paged_descriptors(kv_cache, nb, bs, d, stride_blk, block_n, meta, cfg)
    pps = cfg["progs_per_sm"] if descs is None else cfg["tma_progs_per_sm"]
    per, chunks = _split(cdiv(max_context_len, block_n), b * groups, _num_sms(q.device, num_sms) * pps)
    if descs is not None:
        extra = {"maxnreg": cfg["tma_maxnreg"]} if cfg["tma_maxnreg"] and not interpreting() else {}
        _paged_tma_logits_kernel[(b, chunks, groups)](
            q, q.stride(0), q.stride(1), q.stride(2), *descs, bs, nb, weights, weights.stride(0), weights.stride(1),
            context_lens, block_table, block_table.stride(0), block_table.shape[1], out, out.stride(0),
            max_context_len, next_n, h, per,
            D=d, P=p, H_P2=h_p2, BLOCK_N=block_n, HEAD_PAD=h < h_p2, NUM_STAGES=cfg["tma_stages"],
            FOR_LOOP=meta["FOR_LOOP"], num_warps=warps,
            **extra,
        )  # fmt: skip
        return
    _paged_mqa_logits_kernel[(b, chunks, groups)](
        q, q.stride(0), q.stride(1), q.stride(2), kv_cache, stride_blk, bs, nb, weights, weights.stride(0),
        weights.stride(1), context_lens, block_table, block_table.stride(0), block_table.shape[1], out,
        out.stride(0), max_context_len, next_n, h, per,
        D=d, P=p, H_P2=h_p2, BLOCK_N=block_n, **meta, HEAD_PAD=h < h_p2,
        NUM_STAGES=cfg["num_stages"], num_warps=warps,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ top-k
#
# The k-th best key of each row's [lo, hi) by a radix select over the order-preserving 32-bit key
# of each logit. Default (``compact``): the row is split into segments; ``_topk_hist_kernel`` writes
# each segment's histogram of the key's top byte, then (a second launch) of its next byte among the
# keys whose top byte is the k-th key's; ``_topk_split_kernel`` reads the row's histograms, so knows
# the k-th key's top 16 bits and how many entries each earlier segment holds above and at them, and
# writes its segment's entries above that bucket as int64 rank keys ``key32 << 32 | (2^32 - 1 -
# position)`` into the row's scratch and the bucket's entries into a candidate list (both in
# position order); ``_topk_kernel`` (one program per row) finds the last two digits on the
# candidate list (on the row if the bucket was larger than the list) and selects the entries above
# the k-th key and the lowest-position entries equal to it. Without ``compact`` one program per row
# does every pass over the row (32 / BITS histogram passes, then the select). Either way the row's
# program then sorts its k keys (descending: rank order; left out when the caller asks for no order,
# ``SORTED`` false) and writes the positions, ``-1`` past the row's candidates, or (``SLOTS``) the
# cache slots they map to through the block table.
# (``tl.histogram`` costs about log2(bins) warp ballots plus, per bin a lane owns, log2(bins) mask
# operations and a popcount per 32 entries: ~2.8 warp instructions per entry at 256 bins, which is
# what a histogram level costs on the H200.)


@triton.jit
def _key32(x):
    """Signed int32 keys in the ranking order of fp32 ``x``: larger first, ``-0.0 == +0.0``, NaN
    just below ``-inf``."""
    v = x + 0.0  # -0.0 -> +0.0
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(v != v, -2139095042, key)  # (-inf's key) - 1


@triton.jit
def _scalar_positions(start, one, BLOCK: tl.constexpr, THREADS: tl.constexpr):
    """``start + [0, BLOCK)`` as the compiler must load them one entry per instruction (so the
    tensors keep the layout of a scatter by position: entry ``i * THREADS + t`` in thread ``t``):
    the thread's part is multiplied by ``one``, a 1 the compiler cannot see. Returns the positions
    (int32) and the same as int64 sums of a per-thread and a per-entry constant part, so that a
    thread's loads share one address and differ by immediate offsets (an ``xor`` with a hidden 0,
    or int32 positions widened per entry, cost a 64-bit address, two registers, per load: the row
    then loaded in 8 batches, one memory latency each)."""
    i = tl.arange(0, BLOCK // THREADS)[:, None] * THREADS
    t = tl.arange(0, THREADS)[None, :] * one
    pos = tl.reshape(start + i + t, [BLOCK])
    off = tl.reshape((start + t).to(tl.int64) + i.to(tl.int64), [BLOCK])
    return pos, off


@triton.jit
def _row_chunk(
    row_ptr, start, lo, hi, BLOCK: tl.constexpr, SCALAR: tl.constexpr = 0, n_row=0, INSIDE: tl.constexpr = 0,
):  # fmt: skip
    """``(pos, valid, key, ukey)`` of row entries ``[start, start + BLOCK)`` (``valid``: within ``[lo,
    hi)``). ``SCALAR`` (the program's threads): one entry per load instruction, entry ``i * SCALAR +
    t`` in thread ``t``, so the tensors take the layout of a scatter by position (no layout
    conversion before one); its loads are masked by ``pos < n_row`` (the row's storage, ``n_row >=
    hi``; ``valid`` applies ``[lo, hi)`` after the load) except for the first ``INSIDE`` entries a
    thread, which the caller knows lie inside it (``start + INSIDE * SCALAR <= n_row``): those take
    no mask at all. A mask computed from ``valid`` cost a predicate a load that ptxas kept in a
    bit mask, and it then held only 3-8 of a thread's 64 loads in flight (session 20's SASS); with
    the first half (every row longer than half its power of two) unmasked it holds ~40, then ~35,
    and with the whole row unmasked ~50."""
    if SCALAR:  # (hi >= lo: when not, no entry is valid whatever the positions)
        pos, off = _scalar_positions(start, (hi >= lo).to(tl.int32), BLOCK, SCALAR)
        # (the entry index within the thread as a constant per register: the first INSIDE fold to true)
        ci = tl.reshape(tl.zeros([BLOCK // SCALAR, SCALAR], tl.int32) + tl.arange(0, BLOCK // SCALAR)[:, None], [BLOCK])
        mask = (ci < INSIDE) | (pos < n_row)
    else:
        pos = start + tl.arange(0, BLOCK)
        off = pos
    valid = (pos >= lo) & (pos < hi)
    if not SCALAR:
        mask = valid
    key, ukey = _load_keys(row_ptr, off, mask, INSIDE * SCALAR >= BLOCK)
    return pos, valid, key, ukey


@triton.jit
def _load_keys(row_ptr, off, mask, UNMASKED: tl.constexpr = False):
    """The signed and unsigned 32-bit keys (:func:`_key32`) of ``row_ptr[off]`` where ``mask``
    (those of 0.0 elsewhere; ``UNMASKED``: every ``off`` is inside the row, no mask)."""
    if row_ptr.dtype.element_ty == tl.bfloat16:
        # bf16 -> fp32 as bits (exact; Triton's interpreter, 3.6-3.9, turns bf16 subnormals into
        # other values when it converts them, which reorders the top-k of tiny logits)
        if UNMASKED:
            bits = tl.load(row_ptr.to(tl.pointer_type(tl.int16)) + off)
        else:
            bits = tl.load(row_ptr.to(tl.pointer_type(tl.int16)) + off, mask=mask, other=0)
        x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif UNMASKED:
        x = tl.load(row_ptr + off).to(tl.float32)
    else:
        x = tl.load(row_ptr + off, mask=mask, other=0.0).to(tl.float32)
    key = _key32(x)
    ukey = (key ^ -2147483648).to(tl.uint32, bitcast=True)  # unsigned order
    return key, ukey


@triton.jit
def _digit_hist(hist, valid, ukey, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """``hist`` plus the ``2^BITS``-bin histogram of the digit at ``SHIFT`` of the valid keys whose
    bits above ``SHIFT + BITS`` are ``prefix``."""
    if SHIFT + BITS < 32:
        valid = valid & ((ukey >> (SHIFT + BITS)) == prefix)
    digit = ((ukey >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)
    return hist + tl.histogram(digit, 1 << BITS, mask=valid)


@triton.jit
def _pick_digit(hist, prefix, rem, BITS: tl.constexpr):
    """The digit ``d`` holding the ``rem``-th largest key of ``hist``: ``(prefix << BITS | d, rem -
    count above d, count at d)``."""
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # count with digit >= d
    d = tl.sum((at_or_above >= rem).to(tl.int32), axis=0) - 1
    bins = tl.arange(0, 1 << BITS)
    above = tl.sum(tl.where(bins > d, hist, 0), axis=0)
    at = tl.sum(tl.where(bins == d, hist, 0), axis=0)
    return (prefix << BITS) | d.to(tl.uint32), rem - above, at


@triton.jit
def _rank_keys(key, pos):
    """The select's int64 rank keys: the (signed) key in the high word, ``2^32 - 1 - position`` in
    the low (larger = better; ties by lower position); :func:`_cand_chunk` reads them back."""
    return key.to(tl.int64) * 4294967296 + (4294967295 - pos.to(tl.int64))


@triton.jit
def _unrank(comp):
    """:func:`_rank_keys` undone: ``(pos, key, ukey)`` (int32, signed and unsigned 32-bit keys)."""
    hi32 = comp >> 32
    key = hi32.to(tl.int32)
    pos = (4294967295 - (comp - (hi32 << 32))).to(tl.int32)
    return pos, key, (key ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _cand_chunk(cand, start, n_c, BLOCK: tl.constexpr):
    """Entries ``[start, start + BLOCK)`` of a candidate list of rank keys (``n_c`` long) as
    ``_row_chunk`` gives a row's: ``(pos, valid, key, ukey)``."""
    i = start + tl.arange(0, BLOCK)
    valid = i < n_c
    pos, key, ukey = _unrank(tl.load(cand + i, mask=valid, other=0))
    return pos, valid, key, ukey


@triton.jit
def _chunk(src, start, lo, hi, CAND: tl.constexpr, BLOCK: tl.constexpr):
    """A step of ``BLOCK`` entries of the row (``src`` its logits, ``[lo, hi)``) or of the candidate
    list (``CAND``: ``src`` its rank keys, ``hi`` its length)."""
    if CAND:
        return _cand_chunk(src, start, hi, BLOCK)
    else:
        return _row_chunk(src, start, lo, hi, BLOCK)


@triton.jit
def _radix_pass(
    src, lo, hi, c_lo, prefix, rem, SHIFT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    FOR_LOOP: tl.constexpr, CAND: tl.constexpr = False,
):  # fmt: skip
    """One digit of the select over the row (or the candidate list) in global memory, ``BLOCK``
    entries a step: ``(prefix << BITS | d, rem - count above d, count at d)``."""
    hist = tl.zeros([1 << BITS], tl.int32)
    if FOR_LOOP:
        for start in tl.range(c_lo, hi, BLOCK, num_stages=2):
            _pos, valid, _key, ukey = _chunk(src, start, lo, hi, CAND, BLOCK)
            hist = _digit_hist(hist, valid, ukey, prefix, SHIFT, BITS)
    else:
        start = c_lo
        while start < hi:
            _pos, valid, _key, ukey = _chunk(src, start, lo, hi, CAND, BLOCK)
            hist = _digit_hist(hist, valid, ukey, prefix, SHIFT, BITS)
            start += BLOCK
    return _pick_digit(hist, prefix, rem, BITS)


@triton.jit
def _radix_kth(row_ptr, lo, hi, c_lo, kk, BITS: tl.constexpr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr):
    """The k-th best key of the row by ``32 / BITS`` radix passes over it (:func:`_radix_pass`):
    ``(kth, how many entries equal to it belong to the top kk)``."""
    prefix = tl.zeros([], tl.uint32)
    rem = kk
    for p in tl.static_range(32 // BITS):
        prefix, rem, _at = _radix_pass(row_ptr, lo, hi, c_lo, prefix, rem, 32 - BITS * (p + 1), BITS, BLOCK, FOR_LOOP)
    return prefix, rem


@triton.jit
def _select_pass(
    src, lo, hi, c_lo, kth, need_eq, n_gt, scr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr,
    CAND: tl.constexpr = False,
):  # fmt: skip
    """Every entry above ``kth`` and the first ``need_eq`` equal to it, as rank keys into ``scr``
    from slot ``n_gt`` on."""
    n_gt = n_gt + tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    if FOR_LOOP:
        for start in tl.range(c_lo, hi, BLOCK, num_stages=2):
            pos, valid, key, ukey = _chunk(src, start, lo, hi, CAND, BLOCK)
            n_gt, n_eq = _select_keys(pos, valid, key, ukey, kth, need_eq, n_gt, n_eq, scr)
    else:
        start = c_lo
        while start < hi:
            pos, valid, key, ukey = _chunk(src, start, lo, hi, CAND, BLOCK)
            n_gt, n_eq = _select_keys(pos, valid, key, ukey, kth, need_eq, n_gt, n_eq, scr)
            start += BLOCK
    return n_gt


@triton.jit
def _split_keys(pos, valid, key, ukey, prefix16, n_gt, n_c, scr, cand):
    top = ukey >> 16
    gt = valid & (top > prefix16)
    eq = valid & (top == prefix16)
    comp = _rank_keys(key, pos)
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)  # one scan for both counts (as _select_keys)
    before = tl.cumsum(packed, axis=0) - packed
    tl.store(scr + n_gt + (before & 0xFFFF), comp, mask=gt)
    tl.store(cand + n_c + (before >> 16), comp, mask=eq)
    tot = tl.sum(packed, axis=0)
    return n_gt + (tot & 0xFFFF), n_c + (tot >> 16)


@triton.jit
def _select_keys(pos, valid, key, ukey, kth, need_eq, n_w, n_eq, dst):
    """Write the rank keys of the entries above ``kth`` and of the first ``need_eq`` equal to it
    (``n_eq`` equal ones already seen) to ``dst`` from slot ``n_w`` on; returns the new counts.
    One scan counts both kinds (above: low 16 bits, equal: high; a step holds < 2^16 entries): an
    entry's slot is the entries above before it plus the selected equal ones before it, which are
    ``min(equal before, need_eq)`` less those of earlier steps."""
    gt = valid & (ukey > kth)
    eq = valid & (ukey == kth)
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
    before = tl.cumsum(packed, axis=0) - packed
    eq_before = n_eq + (before >> 16)  # equal entries before this one, all steps
    sel = gt | (eq & (eq_before < need_eq))
    done_eq = tl.minimum(n_eq, need_eq)
    slot = n_w + (before & 0xFFFF) + tl.minimum(eq_before, need_eq) - done_eq
    comp = _rank_keys(key, pos)
    tl.store(dst + slot, comp, mask=sel)
    tot = tl.sum(packed, axis=0)
    n_eq_new = n_eq + (tot >> 16)
    return n_w + (tot & 0xFFFF) + tl.minimum(n_eq_new, need_eq) - done_eq, n_eq_new


@triton.jit
def _row_bounds(lo_ptr, hi_ptr, r, n, k):
    """Row ``r``'s candidate range ``[lo, hi)`` clamped to ``[0, n]``, and ``min(hi - lo, k)``
    (``lo_ptr`` / ``hi_ptr`` None: 0 / ``n``)."""
    if lo_ptr is None:
        lo = tl.zeros([], tl.int32)
    else:
        lo = tl.minimum(tl.maximum(tl.load(lo_ptr + r), 0), n).to(tl.int32)
    if hi_ptr is None:
        hi = tl.maximum(n, lo).to(tl.int32)
    else:
        hi = tl.minimum(tl.maximum(tl.load(hi_ptr + r), lo), n).to(tl.int32)
    return lo, hi, tl.minimum(hi - lo, k)


@triton.jit
def _seg_steps(s, seg_len, lo, hi, BLOCK: tl.constexpr):
    """``[start, end)`` of segment ``s``'s steps of ``BLOCK`` entries within the row's ``[lo, hi)``
    (``start`` a multiple of ``BLOCK``; empty when the segment has none)."""
    seg_lo = s * seg_len
    return tl.maximum(seg_lo, (lo // BLOCK) * BLOCK), tl.minimum(seg_lo + seg_len, hi)


@triton.jit
def _seg_pick(hist, n_seg, s, prefix, rem, S_P2: tl.constexpr, HB: tl.constexpr):
    """The digit of the ``rem``-th largest key from a row's per-segment histograms ``hist [n_seg,
    2^HB]``: ``(prefix << HB | d, rem - count above d, count at d)`` as :func:`_pick_digit`, and the
    counts above ``d`` and at ``d`` in the segments before ``s``."""
    seg = tl.arange(0, S_P2)[:, None]
    h = tl.load(hist + seg * (1 << HB) + tl.arange(0, 1 << HB)[None, :], mask=seg < n_seg, other=0)
    prefix, rem, at = _pick_digit(tl.sum(h, axis=0), prefix, rem, HB)
    d = (prefix & ((1 << HB) - 1)).to(tl.int32)
    before = tl.sum(tl.where(seg < s, h, 0), axis=0)
    bins = tl.arange(0, 1 << HB)
    gt_before = tl.sum(tl.where(bins > d, before, 0), axis=0)
    eq_before = tl.sum(tl.where(bins == d, before, 0), axis=0)
    return prefix, rem, at, gt_before, eq_before


@triton.jit
def _levels_pick(hrow, n_seg, s, kk, LEVELS: tl.constexpr, S_P2: tl.constexpr, HB: tl.constexpr):
    """The first ``LEVELS`` digits (``HB`` bits each) of row's k-th best key from its histogram
    levels: ``(prefix, rem, count at prefix, count above prefix in segments before s, count at
    prefix in segments before s)``."""
    prefix = tl.zeros([], tl.uint32)
    rem = kk
    at = kk
    gt = tl.zeros([], tl.int32)
    eq = tl.zeros([], tl.int32)
    for lv in tl.static_range(LEVELS):
        prefix, rem, at, gt_lv, eq = _seg_pick(hrow + lv * n_seg * (1 << HB), n_seg, s, prefix, rem, S_P2, HB)
        gt += gt_lv
    return prefix, rem, at, gt, eq


@triton.jit
def _topk_hist_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, hist_ptr, stride_hr, n, k, n_seg, seg_len,
    LEVEL: tl.constexpr, HB: tl.constexpr, S_P2: tl.constexpr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    """Grid ``(rows, n_seg)``: ``hist[r, LEVEL, s]`` = the ``2^HB``-bin histogram, over segment
    ``s`` (``seg_len`` entries) of row ``r``'s candidates, of key digit ``LEVEL`` (``HB`` bits from
    the top) among the keys whose higher digits are the k-th best key's (from the row's histograms
    at the lower levels)."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    hrow = hist_ptr + r.to(tl.int64) * stride_hr
    prefix, _rem, _at, _gt, _eq = _levels_pick(hrow, n_seg, s, tl.maximum(kk, 1), LEVEL, S_P2, HB)
    hist = tl.zeros([1 << HB], tl.int32)
    start0, end = _seg_steps(s, seg_len, lo, hi, BLOCK)
    if FOR_LOOP:
        for start in tl.range(start0, end, BLOCK, num_stages=2):
            _pos, valid, _key, ukey = _row_chunk(row_ptr, start, lo, hi, BLOCK)
            hist = _digit_hist(hist, valid, ukey, prefix, 32 - HB * (LEVEL + 1), HB)
    else:
        start = start0
        while start < end:
            _pos, valid, _key, ukey = _row_chunk(row_ptr, start, lo, hi, BLOCK)
            hist = _digit_hist(hist, valid, ukey, prefix, 32 - HB * (LEVEL + 1), HB)
            start += BLOCK
    tl.store(hrow + (LEVEL * n_seg + s) * (1 << HB) + tl.arange(0, 1 << HB), hist)


@triton.jit
def _topk_split_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, hist_ptr, stride_hr, scr_ptr, stride_sr, cand_ptr, stride_cr,
    n, k, n_seg, seg_len, cap, HB: tl.constexpr, S_P2: tl.constexpr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    """Grid ``(rows, n_seg)``: from the histogram levels, the k-th best key's top 16 bits ``p16``;
    when the row holds at most ``cap`` entries with those bits, segment ``s`` writes its entries
    above ``p16`` as rank keys into ``scr[r]`` and those at ``p16`` into ``cand[r]``, each after
    the earlier segments' (so both lists are in position order)."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    hrow = hist_ptr + r.to(tl.int64) * stride_hr
    if kk > 0:
        p16, _rem, at, n_gt, n_c = _levels_pick(hrow, n_seg, s, kk, 16 // HB, S_P2, HB)
        if at <= cap:
            scr = scr_ptr + r.to(tl.int64) * stride_sr
            cand = cand_ptr + r.to(tl.int64) * stride_cr
            start0, end = _seg_steps(s, seg_len, lo, hi, BLOCK)
            if FOR_LOOP:
                for start in tl.range(start0, end, BLOCK, num_stages=2):
                    pos, valid, key, ukey = _row_chunk(row_ptr, start, lo, hi, BLOCK)
                    n_gt, n_c = _split_keys(pos, valid, key, ukey, p16, n_gt, n_c, scr, cand)
            else:
                start = start0
                while start < end:
                    pos, valid, key, ukey = _row_chunk(row_ptr, start, lo, hi, BLOCK)
                    n_gt, n_c = _split_keys(pos, valid, key, ukey, p16, n_gt, n_c, scr, cand)
                    start += BLOCK


@triton.jit
def _topk_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, scr_ptr, stride_sr, out_ptr, stride_or, n, k,
    bt_ptr, stride_bt, n_log, pbs, next_n, cand_ptr, stride_cr, cap, hist_ptr, stride_hr, n_seg,
    BLOCK: tl.constexpr, BITS: tl.constexpr, K_P2: tl.constexpr, SLOTS: tl.constexpr, FOR_LOOP: tl.constexpr,
    COMPACT: tl.constexpr, S_P2: tl.constexpr = 1, HB: tl.constexpr = 8, PROFILE: tl.constexpr = 0,
    SORTED: tl.constexpr = True,
):  # fmt: skip
    """Grid ``(rows,)``: ``out[r, :min(k, K_P2)]`` = row ``r``'s best positions in rank order
    (without ``SORTED``: in the order the select wrote them, the final sort left out; ``-1`` past
    its ``min(k, hi - lo)`` candidates either way), or with ``SLOTS`` their cache slots through
    ``block_table[r // next_n]`` (``-1`` where a position has none). ``scr[r, :K_P2]``: scratch.
    ``COMPACT`` (8-bit digits; after :func:`_topk_hist_kernel` at its ``16 / HB`` levels and
    :func:`_topk_split_kernel`): the k-th key's top 16 bits come from the row's histograms; when
    its bucket fit in ``cap``, the last two digits and the select read only the candidate list
    ``cand[r, :cap]`` (the entries above the bucket are already in ``scr``), else the row."""
    tl.static_assert(BLOCK <= 16384, "the select packs two counts of a step into one int32 (the high one < 2^15)")
    r = tl.program_id(0)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    scr = scr_ptr + r.to(tl.int64) * stride_sr
    if kk > 0:
        c_lo = (lo // BLOCK) * BLOCK
        prefix = tl.zeros([], tl.uint32)
        rem = kk
        if COMPACT:
            hrow = hist_ptr + r.to(tl.int64) * stride_hr
            prefix, rem, at, _gt, _eq = _levels_pick(hrow, n_seg, 0, kk, 16 // HB, S_P2, HB)
            if at <= cap:  # kk - rem entries above the bucket are in scr; the bucket's `at` in cand
                cand = cand_ptr + r.to(tl.int64) * stride_cr
                n_gt = kk - rem
                prefix, rem, _at = _radix_pass(cand, 0, at, 0, prefix, rem, 8, 8, BLOCK, FOR_LOOP, True)
                prefix, rem, _at = _radix_pass(cand, 0, at, 0, prefix, rem, 0, 8, BLOCK, FOR_LOOP, True)
                _select_pass(cand, 0, at, 0, prefix, rem, n_gt, scr, BLOCK, FOR_LOOP, True)
            else:
                prefix, rem, _at = _radix_pass(row_ptr, lo, hi, c_lo, prefix, rem, 8, 8, BLOCK, FOR_LOOP)
                prefix, rem, _at = _radix_pass(row_ptr, lo, hi, c_lo, prefix, rem, 0, 8, BLOCK, FOR_LOOP)
                _select_pass(row_ptr, lo, hi, c_lo, prefix, rem, 0, scr, BLOCK, FOR_LOOP)
        else:
            prefix, rem = _radix_kth(row_ptr, lo, hi, c_lo, kk, BITS, BLOCK, FOR_LOOP)
            if PROFILE < 2:
                _select_pass(row_ptr, lo, hi, c_lo, prefix, rem, 0, scr, BLOCK, FOR_LOOP)
            else:  # (profiling: the radix passes alone; the result written so they are kept)
                tl.store(scr, prefix.to(tl.int64) + rem)
    _emit_topk(
        scr, r, kk, k, out_ptr, stride_or, bt_ptr, stride_bt, n_log, pbs, next_n, K_P2, SLOTS, SORTED and PROFILE == 0
    )


@triton.jit
def _emit_topk(
    scr, r, kk, k, out_ptr, stride_or, bt_ptr, stride_bt, n_log, pbs, next_n,
    K_P2: tl.constexpr, SLOTS: tl.constexpr, SORTED: tl.constexpr,
):  # fmt: skip
    """Row ``r``'s ``kk`` selected rank keys (``scr[:kk]``) written out: in rank order (``SORTED``)
    or as selected, as positions or (``SLOTS``) cache slots, ``-1`` after them up to ``K_P2``."""
    tl.debug_barrier()  # every thread's scratch stores before any thread's loads
    rank = tl.arange(0, K_P2)
    top = tl.load(scr + rank, mask=rank < kk, other=-9223372036854775808)
    if SORTED:
        top = tl.sort(top, descending=True)
    low = top - ((top >> 32) << 32)  # 2^32 - 1 - position
    res = tl.where(rank < kk, 4294967295 - low, -1)
    if SLOTS:  # block_table[r // next_n, t // pbs] * pbs + t % pbs; -1 where there is none
        res = table_slots(res, bt_ptr + (r // next_n).to(tl.int64) * stride_bt, 1, n_log, pbs, rank < k)
    tl.store(out_ptr + r.to(tl.int64) * stride_or + rank, res.to(tl.int32), mask=rank < k)


@triton.jit
def _bisect_down(ukey, kth, cnt, b, kk, stop, END: tl.constexpr = 32):
    """Bits ``b..END-1`` (from the top) of the k-th best key, while more than ``stop`` keys are at or
    above it: ``kth`` holds the bits found (the largest value with at least ``kk`` keys of ``ukey``
    at or above it so far), ``cnt`` how many are. A bit is a count of the keys at or above
    ``kth | bit``: a compare and an add per entry, no histogram. Returns ``(kth, cnt, b)``."""
    while (b < END) & (cnt > stop):
        cand = kth | (tl.full([], 0x80000000, tl.uint32) >> b.to(tl.uint32))
        c = tl.sum((ukey >= cand).to(tl.int32))
        kth = tl.where(c >= kk, cand, kth)
        cnt = tl.where(c >= kk, c, cnt)
        b += 1
    return kth, cnt, b


@triton.jit
def _f16x2_ge(p, c, ASM: tl.constexpr):
    """Per 16-bit lane of int32 ``p`` / ``c`` (fp16 bit patterns of whole lanes up to 0x3FFF):
    ``p >= c`` as fp16 1.0 / 0.0 (``ASM``: one ``set.ge.f16x2``; else the same comparison as
    integer lanes 1 / 0, for Triton's interpreter, which runs no PTX)."""
    if ASM:
        return tl.inline_asm_elementwise("set.ge.f16x2.f16x2 $0, $1, $2;", "=r,r,r", [p, c], tl.int32, True, 1)
    else:
        return ((p & 0xFFFF) >= (c & 0xFFFF)).to(tl.int32) + ((p >> 16) >= (c >> 16)).to(tl.int32) * 65536


@triton.jit
def _f16x2_add(a, b):
    return tl.inline_asm_elementwise("add.f16x2 $0, $1, $2;", "=r,r,r", [a, b], tl.int32, True, 1)


@triton.jit
def _f16x2_lanes(a, ASM: tl.constexpr):
    """The sum of the two lanes of ``a`` (fp16 whole numbers up to 2048; without ``ASM`` the
    integer lanes of :func:`_f16x2_ge`'s stand-in) as an int32."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 l, h; mov.b32 {l, h}, $1; add.f16 l, l, h; cvt.rni.s32.f16 $0, l; }",
            "=r,r",
            [a],
            tl.int32,
            True,
            1,
        )
    else:
        return (a & 0xFFFF) + (a >> 16)


@triton.jit
def _bisect_down16(ukey, kth, cnt, b, kk, stop, THREADS: tl.constexpr, ASM: tl.constexpr):
    """:func:`_bisect_down` for bits ``b..14`` (``b >= 1``: the top bit is found) with two keys a
    32-bit register: each key's bits 30..17 as a 14-bit lane (0x3FFF for keys whose top bit is
    above the k-th's, 0 for those below: the same counts as the 32-bit keys, as every candidate
    here has a bit set among 30..17 and none below), compared two at a time as fp16 bit patterns
    (all finite and ordered as the integers) by one ``set.ge.f16x2`` and summed within the thread
    by ``add.f16x2`` (at most ``N_P2 / THREADS / 2`` <= 512 a lane, and fp16 holds whole numbers up
    to 2048: exact): about one instruction a key and bit, where the
    32-bit compare, select and add take ~2.7, two of them on the half-rate integer pipe. Without
    ``ASM`` (Triton's interpreter) the lanes are compared and summed as integers."""
    top = kth & 0x80000000
    v = tl.where((ukey & 0x80000000) == top, (ukey >> 17) & 0x3FFF, tl.where(ukey > (top | 0x7FFFFFFF), 0x3FFF, 0))
    return _bisect_packed(_pair_lanes(v.to(tl.int32), THREADS), kth, cnt, b, kk, stop, ASM)


@triton.jit
def _pair_lanes(v, THREADS: tl.constexpr):
    """16-bit values ``v`` (one an entry, the row layout) two a register: entries ``2a`` and ``2a + 1``
    of a thread in the low and high half of word ``a`` (``[entries / 2 per thread, THREADS]``). The
    high half by a shift: a multiply would overflow int32 for values of 0x8000 or more (the keys'
    top halves), which debug builds check."""
    v3 = tl.reshape(v, [v.shape[0] // THREADS // 2, 2, THREADS])
    return tl.sum(tl.where(tl.arange(0, 2)[None, :, None] == 0, v3, v3 << 16), axis=1)


@triton.jit
def _bisect_packed(packed, kth, cnt, b, kk, stop, ASM: tl.constexpr):
    """The loop of :func:`_bisect_down16` on the 14-bit lanes ``packed`` (two a register)."""
    while (b < 15) & (cnt > stop):
        cand = kth | (tl.full([], 0x80000000, tl.uint32) >> b.to(tl.uint32))
        c14 = ((cand >> 17) & 0x3FFF).to(tl.int32)
        ge = _f16x2_ge(packed, tl.zeros(packed.shape, tl.int32) + (c14 | (c14 << 16)), ASM)
        if ASM:
            c = tl.sum(_f16x2_lanes(tl.reduce(ge, 0, _f16x2_add), ASM))
        else:  # (integer lanes of at most 512 a thread: one int32 sum adds both without carries)
            c = tl.sum(_f16x2_lanes(tl.sum(ge, 0), ASM))
        kth = tl.where(c >= kk, cand, kth)
        cnt = tl.where(c >= kk, c, cnt)
        b += 1
    return kth, cnt, b


@triton.jit
def _column_slots(sel, THREADS: tl.constexpr, VEC: tl.constexpr = 1):
    """Slots ``0..`` of the ``True`` entries of ``sel`` taken thread by thread, for a layout of
    ``VEC`` consecutive entries a thread in turn (entry ``(i * THREADS + t) * VEC + v`` is thread
    ``t``'s ``i``-th vector's ``v``-th): scans within each thread and one over the ``THREADS``
    thread totals, in place of a scan across threads for each step of the tensor."""
    if VEC == 1:
        f = tl.reshape(sel.to(tl.int32), [sel.shape[0] // THREADS, THREADS])
        col = tl.sum(f, axis=0)
        return tl.reshape((tl.cumsum(col, axis=0) - col)[None, :] + tl.cumsum(f, axis=0) - f, [sel.shape[0]])
    else:
        f = tl.reshape(sel.to(tl.int32), [sel.shape[0] // (THREADS * VEC), THREADS, VEC])
        vec = tl.sum(f, axis=2)
        col = tl.sum(vec, axis=0)
        before = (tl.cumsum(col, axis=0) - col)[None, :] + tl.cumsum(vec, axis=0) - vec
        return tl.reshape(before[:, :, None] + tl.cumsum(f, axis=2) - f, [sel.shape[0]])


@triton.jit
def _finish_from_list(
    row_ptr, cand, cnt, kth, b, kk, scr, emit, CAP: tl.constexpr, THREADS: tl.constexpr, TIE_BITS: tl.constexpr,
    N_P2: tl.constexpr, STOP: tl.constexpr, DIRECT: tl.constexpr, SLOTS: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    """On the list of the ``cnt`` positions whose keys are at or above ``kth`` (``b`` bits found;
    ``cand`` holds them as int32, their keys loaded from the row ``row_ptr`` again): the remaining bits,
    the tie cut (the lowest positions among keys equal to the k-th) and the selected keys into the
    scratch (:func:`_topk_bisect_kernel`), or (``DIRECT``: the unsorted output, in the same slots
    :func:`_emit_topk` would copy them to) their positions or (``SLOTS``) cache slots straight into
    the output row, ``emit = (out_row, k, table_row, n_log, pbs)``, with ``-1`` in its columns
    ``kk .. min(k, K_P2) - 1``: no scratch stores and loads between the list and the output."""
    tl.debug_barrier()  # every thread's candidates before any thread's loads
    if STOP != 2:
        # the list's positions (int32), their keys from the row again (L2: it was read just before)
        c_i, c_off = _scalar_positions(0, (cnt >= 0).to(tl.int32), CAP, THREADS)  # (as the row's)
        c_valid = c_i < cnt
        c_pos = tl.load(cand.to(tl.pointer_type(tl.int32)) + c_off, mask=c_valid, other=0)
        c_key, c_ukey = _load_keys(row_ptr, c_pos.to(tl.int64), c_valid)
        c_ukey = tl.where(c_valid, c_ukey, 0)
        _finish_keys(c_pos, c_valid, c_key, c_ukey, cnt, kth, b, kk, scr, emit, THREADS, TIE_BITS, N_P2,
                     STOP == 0, DIRECT, SLOTS, K_P2)  # fmt: skip


@triton.jit
def _finish_keys(
    c_pos, c_valid, c_key, c_ukey, cnt, kth, b, kk, scr, emit, THREADS: tl.constexpr, TIE_BITS: tl.constexpr,
    N_P2: tl.constexpr, WRITE: tl.constexpr, DIRECT: tl.constexpr, SLOTS: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    """:func:`_finish_from_list` on a list in registers (the layout of :func:`_scalar_positions`):
    positions ``c_pos``, ``c_valid``, keys ``c_key`` / ``c_ukey`` (0 where not valid), ``cnt`` of
    them at or above ``kth`` whose top ``b`` bits are the k-th key's. ``WRITE`` false: the bits only
    (a timing stop)."""
    kth, cnt, b = _bisect_down(c_ukey, kth, cnt, b, kk, kk)
    # the entries above the k-th key, and of those equal to it the `need` lowest positions
    # (tie key N_P2 - position among them, 0 for the rest: the largest `need` of it)
    n_gt = tl.sum((c_ukey > kth).to(tl.int32))
    eq = c_valid & (c_ukey == kth)
    tie = tl.where(eq, N_P2 - c_pos, 0).to(tl.uint32)
    cut = tl.zeros([], tl.uint32)
    if cnt > kk:  # (only when all 32 bits are found: then kk > n_gt)
        b = tl.full([], 31 - TIE_BITS, tl.int32)  # tie keys are at most N_P2
        cut, _c, _b = _bisect_down(tie, cut, cnt - n_gt, b, kk - n_gt, kk - n_gt)
    take = (c_ukey > kth) | (eq & (tie >= cut))
    if WRITE:
        slots = _column_slots(take, THREADS)
        if DIRECT:
            out_row, k, bt_row, n_log, pbs = emit
            res = c_pos.to(tl.int64)
            if SLOTS:
                res = table_slots(res, bt_row, 1, n_log, pbs, take)
            tl.store(out_row + slots, res.to(tl.int32), mask=take)
            rank = tl.arange(0, K_P2)
            tl.store(out_row + rank, tl.full([K_P2], -1, tl.int32), mask=(rank >= kk) & (rank < k))
        else:
            tl.store(scr + slots, _rank_keys(c_key, c_pos), mask=take)


@triton.jit
def _list_or_select(
    row_ptr, lo, hi, pos, ukey, kth, cnt, b, kk, cand_row, scr, emit, CAP: tl.constexpr, THREADS: tl.constexpr,
    TIE_BITS: tl.constexpr, N_P2: tl.constexpr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr, STOP: tl.constexpr,
    VEC: tl.constexpr, DIRECT: tl.constexpr, SLOTS: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    """After the top bits on the row's 32-bit keys ``ukey``: at most ``CAP`` positions of keys at or above ``kth``
    gathered into the row's candidate list (``cand_row = (cand_ptr, r, stride_cr)``) and finished
    there (:func:`_finish_from_list`), or (all 32 bits found and more than ``CAP`` keys equal to the
    k-th) the select pass over the row. Returns 1 where the output row is written (``DIRECT`` and
    the list), else 0 (the scratch holds the selected keys for :func:`_emit_topk`)."""
    written = tl.zeros([], tl.int32)
    if cnt <= CAP:
        sel = ukey >= tl.maximum(kth, 1)
        cand = cand_row[0] + cand_row[1].to(tl.int64) * cand_row[2]
        tl.store(cand.to(tl.pointer_type(tl.int32)) + _column_slots(sel, THREADS, VEC), pos, mask=sel)
        _finish_from_list(
            row_ptr, cand, cnt, kth, b, kk, scr, emit, CAP, THREADS, TIE_BITS, N_P2, STOP, DIRECT, SLOTS, K_P2
        )
        if DIRECT and STOP == 0:
            written += 1
    else:
        n_gt = tl.sum((ukey > kth).to(tl.int32))
        _select_pass(row_ptr, lo, hi, (lo // BLOCK) * BLOCK, kth, kk - n_gt, 0, scr, BLOCK, FOR_LOOP)
    return written


@triton.jit
def _topk_bisect_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, scr_ptr, stride_sr, out_ptr, stride_or, n, k,
    bt_ptr, stride_bt, n_log, pbs, next_n, cand_ptr, stride_cr,
    N_P2: tl.constexpr, BLOCK: tl.constexpr, K_P2: tl.constexpr, CAP: tl.constexpr, THREADS: tl.constexpr,
    TIE_BITS: tl.constexpr, SLOTS: tl.constexpr, SORTED: tl.constexpr, FOR_LOOP: tl.constexpr,
    STOP: tl.constexpr = 0, VEC: tl.constexpr = 1, PACK16: tl.constexpr = False, INSIDE: tl.constexpr = 0,
):  # fmt: skip
    """Grid ``(rows,)``, rows of at most ``N_P2`` entries (``2^TIE_BITS``), ``THREADS`` threads a program: the row's
    keys read once into registers (entry ``i`` of thread ``t``: position ``i * THREADS + t``); the
    k-th best key's top bits found bit by bit (:func:`_bisect_down`) only until at most ``CAP`` keys
    are at or above them; their positions gathered thread by thread (:func:`_column_slots`) into
    ``cand[r]`` (as int32: 4 bytes an entry, where 8-byte rank keys made ptxas spill every key
    before the stores; the keys are loaded from the row again, from L2); on that list, the remaining bits, then (when more keys equal the k-th than the top k
    has room for) the lowest positions among them by the same bisection, and the selected keys
    gathered into the scratch; the output as :func:`_topk_kernel` (without ``SORTED``: in the
    gathered order, the same on every call). More than ``CAP`` keys equal to the k-th (all 32 bits
    found) take the select pass over the row instead. ``STOP`` (timing only, wrong results): 1 ends
    after the top bits, 2 after the list, 3 before the output, 4 after the row's load (no bits). ``VEC`` 4 (an experiment, not yet
    timed): 16-byte loads of the row (the list's scatter store then converts the layout)."""
    tl.static_assert(N_P2 % THREADS == 0 and CAP % THREADS == 0, "rows and lists fill every thread")
    tl.static_assert(not PACK16 or N_P2 >= 2 * THREADS, "two keys a thread to pack")
    r = tl.program_id(0)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    scr = scr_ptr + r.to(tl.int64) * stride_sr
    out_row = out_ptr + r.to(tl.int64) * stride_or
    written = tl.zeros([], tl.int32)
    if kk > 0:
        pos, valid, _key, ukey = _row_chunk(
            row_ptr, 0, lo, hi, N_P2, SCALAR=THREADS if VEC == 1 else 0, n_row=n, INSIDE=INSIDE
        )
        ukey = tl.where(valid, ukey, 0)  # (0: out of range)
        # the top bits: cnt = valid keys >= kth (every key's is > 0, so kth 0 counts them all)
        stop = N_P2 if STOP == 4 else CAP  # (4: no bits, the load alone)
        if PACK16:  # the top bit, then bits 1..14 two keys a register, then the rest
            kth, cnt, b = _bisect_down(ukey, tl.zeros([], tl.uint32), hi - lo, tl.zeros([], tl.int32), kk, stop, 1)
            if cnt > stop:
                kth, cnt, b = _bisect_down16(ukey, kth, cnt, b, kk, stop, THREADS, FOR_LOOP)  # (FOR_LOOP: compiled)
            kth, cnt, b = _bisect_down(ukey, kth, cnt, b, kk, stop)
        else:
            kth, cnt, b = _bisect_down(ukey, tl.zeros([], tl.uint32), hi - lo, tl.zeros([], tl.int32), kk, stop)
        if STOP == 4:
            tl.store(scr, kth.to(tl.int64) + cnt + tl.sum(ukey.to(tl.int64)))
        elif STOP == 1:
            tl.store(scr, kth.to(tl.int64) + cnt)
        else:
            emit = (out_row, k, bt_ptr + (r // next_n).to(tl.int64) * stride_bt, n_log, pbs)
            written = _list_or_select(
                row_ptr, lo, hi, pos, ukey, kth, cnt, b, kk, (cand_ptr, r, stride_cr), scr, emit, CAP, THREADS,
                TIE_BITS, N_P2, BLOCK, FOR_LOOP, STOP, VEC, not SORTED, SLOTS, K_P2,
            )  # fmt: skip
    if written == 0:
        _emit_topk(scr, r, kk, k, out_ptr, stride_or, bt_ptr, stride_bt, n_log, pbs, next_n, K_P2, SLOTS, SORTED)


# ------------------------------------------------------------------------ top-k: the split path
#
# The register path holds a row of 32K in one program's registers: 256 such rows run as two waves
# of one program an SM, each a chain of ~30 CTA-wide sums with the memory idle after the row's
# load. The split path spreads the row's read over the whole GPU and keeps the chains short:
# (1) ``_topk_threshold_kernel`` (one program a row) bisects a fixed sample of the row (SAMPLE_G
#     segments of SAMPLE_L entries evenly spread over ``[lo, hi)``) for a threshold ``T`` the
#     row's keys should pass about ``(kk + CAP) / 2`` times (every valid key when the range holds
#     at most ``CAP``);
# (2) ``_topk_split_pos_kernel``, grid ``(rows, chunks)``, streams the row and writes the rank keys
#     (key and position) of its keys at or above ``T``, in position order, into the chunk's part of
#     a buffer, and their count (each launch after the first a programmatic dependent of the one
#     before on Hopper, the threshold's letting the row loads start at once);
# (3) ``_topk_list_kernel`` (one program a row) reads the row's counts: when ``kk <= count <=
#     CAP`` (every key of the top ``kk`` is at or above ``T``: exact) it gathers the list, finds the
#     k-th key on it (from the bits all candidates share) and writes the output as the register
#     path's list does; otherwise (none, unless the sample misjudged the row: ties spanning the
#     threshold, or a row whose top keys the sample missed) it flags the row and does it itself by
#     the radix select over the row from memory (slow, and light on registers: the kernel keeps two
#     programs an SM; session 23 measured this 1.3-1.9 µs faster than a register-path launch for
#     the flagged rows after it, which cost ~3.4 µs with nothing to do).
# The set is the same as the register path's in every case (the same tie rule); the unsorted order
# is the same on every call, but not the register path's (the list's slots are taken thread by
# thread, :func:`_column_slots`, over other layouts).


@triton.jit
def _topk_threshold_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, t_ptr, n, k, CAP: tl.constexpr, SAMPLE_G: tl.constexpr,
    SAMPLE_L: tl.constexpr, END: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(rows,)``: ``t[r]`` (int32 bits of a uint32 key) the largest ``END``-bit prefix with at
    least ``ceil(target * S / (hi - lo))`` of the row's ``S = SAMPLE_G * SAMPLE_L`` sample keys at or
    above it, ``target = (kk + CAP) // 2``; 1 (every valid key) when ``hi - lo <= CAP``. ``PDL``: the
    positions kernel (a programmatic dependent) may start at once: its row loads do not need ``t``."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    nv = hi - lo
    t = tl.full([], 1, tl.uint32)
    if nv > CAP:  # (CAP >= S: the segments are disjoint and inside [lo, hi))
        S: tl.constexpr = SAMPLE_G * SAMPLE_L
        seg = (tl.arange(0, SAMPLE_G) * nv) // SAMPLE_G
        spos = tl.reshape(lo + seg[:, None] + tl.arange(0, SAMPLE_L)[None, :], [S])
        _key, sukey = _load_keys(row_ptr, spos.to(tl.int64), spos < hi)
        rs = ((kk + CAP) // 2 * S + nv - 1) // nv
        kth, _c, _b = _bisect_down(sukey, tl.zeros([], tl.uint32), tl.full([], S, tl.int32), tl.zeros([], tl.int32),
                                   rs, rs, END)  # fmt: skip
        t = tl.maximum(kth, 1)
    tl.store(t_ptr + r, t.to(tl.int32, bitcast=True))


@triton.jit
def _topk_split_pos_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, t_ptr, rk_ptr, stride_kr, cnt_ptr, stride_cr, n,
    CHUNK: tl.constexpr, THREADS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(rows, chunks)``: the rank keys (:func:`_rank_keys`: key and position, so that the list
    needs no gathers from the row, which L2 no longer holds) of chunk ``c``'s valid keys at or above
    ``t[r]``, in position order, at ``rk[r, c * CHUNK:]``, and their count at ``cnt[r, c]``. ``PDL``:
    a programmatic dependent of :func:`_topk_threshold_kernel`, waiting for ``t`` after its loads."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, _kk = _row_bounds(lo_ptr, hi_ptr, r, n, 1)
    start = c * CHUNK
    if start + CHUNK <= n:  # (every load inside the row: no masks, all of them in flight)
        pos, valid, key, ukey = _row_chunk(row_ptr, start, lo, hi, CHUNK, THREADS, n, CHUNK // THREADS)
    else:
        pos, valid, key, ukey = _row_chunk(row_ptr, start, lo, hi, CHUNK, THREADS, n, 0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.load(t_ptr + r).to(tl.uint32, bitcast=True)
    sel = valid & (ukey >= t)
    dst = rk_ptr + r.to(tl.int64) * stride_kr + start
    tl.store(dst + _column_slots(sel, THREADS), _rank_keys(key, pos), mask=sel)
    tl.store(cnt_ptr + r.to(tl.int64) * stride_cr + c, tl.sum(sel.to(tl.int32)))


@triton.jit
def _max_pair(a0, a1, b0, b1):
    return tl.maximum(a0, b0), tl.maximum(a1, b1)


@triton.jit
def _topk_list_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, rk_ptr, stride_kr, cnt_ptr, stride_cr, flag_ptr, scr_ptr, stride_sr,
    out_ptr, stride_or, n, k, bt_ptr, stride_bt, n_log, pbs, next_n,
    NCH: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr, THREADS: tl.constexpr, TIE_BITS: tl.constexpr,
    N_P2: tl.constexpr, K_P2: tl.constexpr, SLOTS: tl.constexpr, SORTED: tl.constexpr, STOP: tl.constexpr = 0,
    PDL: tl.constexpr = False, BLOCK: tl.constexpr = 1024, FOR_LOOP: tl.constexpr = True,
):  # fmt: skip
    """Grid ``(rows,)``: the row's list from :func:`_topk_split_pos_kernel` (``NCH`` chunks' parts,
    in position order) when it holds ``kk..CAP`` entries, finished as the register path's list
    (:func:`_finish_keys`) from the bits every entry shares; ``flag[r]`` 1 (the list does not hold
    the top ``kk``, or exceeds ``CAP``) or 0. ``PDL``: a
    programmatic dependent of the positions kernel. A flagged row is done here too, by the radix
    select over the row (``x_ptr``) from memory, ``BLOCK`` entries a step (four 8-bit passes and the
    select: slow, rare, and light on registers), so that no launch follows."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0)
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    scr = scr_ptr + r.to(tl.int64) * stride_sr
    out_row = out_ptr + r.to(tl.int64) * stride_or
    flag = tl.zeros([], tl.int32)
    written = tl.zeros([], tl.int32)
    if kk > 0:
        # list entry i lies in the chunk part holding it: i plus the unused slots of the parts before
        i, _off = _scalar_positions(0, (kk > 0).to(tl.int32), CAP, THREADS)
        off = i
        total = tl.zeros([], tl.int32)
        prev = tl.zeros([], tl.int32)
        for c in tl.static_range(NCH):
            cnt_c = tl.load(cnt_ptr + r.to(tl.int64) * stride_cr + c)
            if c > 0:
                off += tl.where(i >= total, CHUNK - prev, 0)
            prev = cnt_c
            total += cnt_c
        if (total >= kk) & (total <= CAP):
            c_valid = i < total
            c_pos, c_key, c_ukey = _unrank(tl.load(rk_ptr + r.to(tl.int64) * stride_kr + off, mask=c_valid, other=0))
            c_ukey = tl.where(c_valid, c_ukey, 0)
            # the top bits every entry shares are the k-th key's
            ones = tl.full([], 0xFFFFFFFF, tl.uint32)  # (`~` on uint32 fails in Triton's interpreter)
            mx, nmn = tl.reduce((c_ukey, tl.where(c_valid, c_ukey ^ ones, 0)), 0, _max_pair)
            diff = mx ^ nmn ^ ones
            b = tl.zeros([], tl.int32)
            while (b < 32) & (((diff << tl.minimum(b, 31).to(tl.uint32)) & 0x80000000) == 0):
                b += 1
            kth = tl.where(b >= 32, mx, mx & ((ones >> tl.minimum(b, 31).to(tl.uint32)) ^ ones))
            emit = (out_row, k, bt_ptr + (r // next_n).to(tl.int64) * stride_bt, n_log, pbs)
            _finish_keys(c_pos, c_valid, c_key, c_ukey, total, kth, b, kk, scr, emit, THREADS, TIE_BITS, N_P2,
                         STOP == 0, not SORTED, SLOTS, K_P2)  # fmt: skip
            if not SORTED:
                written += 1
        else:
            flag += 1  # the radix select over the row; the output from the scratch below
            row_ptr = x_ptr + r.to(tl.int64) * stride_xr
            c_lo = (lo // BLOCK) * BLOCK
            kth, rem = _radix_kth(row_ptr, lo, hi, c_lo, kk, 8, BLOCK, FOR_LOOP)
            _select_pass(row_ptr, lo, hi, c_lo, kth, rem, 0, scr, BLOCK, FOR_LOOP)
    tl.store(flag_ptr + r, flag)
    if written == 0:
        _emit_topk(scr, r, kk, k, out_ptr, stride_or, bt_ptr, stride_bt, n_log, pbs, next_n, K_P2, SLOTS, SORTED)


#: launch parameters of the top-k: ``bisect``: rows of at most this many entries (rounded up to a
#: power of two) take :func:`_topk_bisect_kernel` (the row in one program's registers; 0: never), with
#: up to ``bisect_warps`` warps (fewer for short rows: one per 2048 entries, at least 4) and a list
#: of up to ``bisect_cap`` x k keys (both powers of two; ``bisect_vec_load``: the row read by 16-byte
#: loads, an experiment; ``bisect_pack16``: the top bits two keys a register, fp16 compares; off with
#: ``bisect_vec_load`` or fewer than two entries a thread; ``bisect_maxnreg``: the register cap of
#: that kernel, 0 = the compiler's choice: 128 at 16 warps, one program per SM; 64 lets two rows
#: share an SM, with 920 B of spill stores a thread offline against 304 at 128, on the H200 134.4 µs against 112.7 at 256 rows, session 17); longer rows
#: take the radix select: ``bits`` per radix pass of the per-row kernel (a power of two up to
#: 16), ``block`` row entries a step, ``num_warps``; ``compact`` (8-bit digits): the candidate list's
#: capacity per row (0: one kernel does every pass over the row); ``programs_per_sm``: the row split
#: of the histogram and split kernels (about this many programs per SM, at most 16 segments a row);
#: ``hist_bits`` (4 or 8): bits per histogram level (16 / hist_bits levels); ``split_block``: the
#: split kernel's step; ``final_warps``: the per-row kernel's warps after a split (0: ``num_warps``);
#: ``profile`` (timing only, wrong results, compact 0: 1 leaves out the final sort, 2 also the
#: select pass). H200 sweep (``benchmarks/indexer_sweep.py --only topk``, 256 x 32K, k 2048, kernel
#: time, session 7): this default 223 us; 8 programs per SM 226; 4-warp final kernel 231-234;
#: 4-bit levels 246; one kernel (compact 0) 289 (radix passes 198, select 52, sort 37).
#: ``split``: rows of at least this many entries (and within ``bisect``) take the split path (0: never;
#: H200, 256 rows, k 2048, unsorted, graph, session 22: 38.4 / 37.7 / 38.2 us at 8192 / 12288 / 16384
#: entries against the register path's 38.9 / 47.6 / 44.4; shorter rows not measured), with
#: ``split_chunk`` entries per program of the positions kernel (``split_warps`` warps), a list of up
#: to ``split_cap`` x k entries (``split_list_warps`` warps), a sample of ``split_sample`` entries
#: (``split_sample_warps`` warps). H200 (256 x 32768, k 2048, graph, session 21): unsorted 42.5 us
#: against the register path's 53.9, rank order 78.4 / 91.4. Session 22:
#: 8192-entry chunks (8 or 16 warps) 52-53 us, 2048-entry chunks of 4 warps 45.9 (against 44.8 in
#: that build); the list's and sample's bisection two bits a step (three counts from one reduction)
#: 44.8 against 42.1 (the list kernel 17.0 -> 19.2 us: docs/experiments/topk_two_bits.patch). Session 23:
#: the flagged rows inside the list kernel (no fourth launch): unsorted 42.0 -> 40.7-41.3 us, rank order
#: 78.3 -> 76.5, 16384 entries 38.0 -> 36.3; histogram digits and a search by value for the list's
#: k-th key both no faster (docs/experiments/topk_histogram_digits.patch, topk_narrow_by_value.patch).
TOPK_CONFIG = dict(
    bits=8, block=2048, num_warps=4, compact=2048, programs_per_sm=4, hist_bits=8, split_block=2048, final_warps=8,
    bisect=32768, bisect_warps=16, bisect_cap=2, bisect_pack16=True, bisect_maxnreg=0,
    split=8192, split_chunk=4096, split_warps=8, split_cap=2, split_list_warps=16, split_sample=2048, split_sample_warps=4,
)  # fmt: skip
_MAX_SEGMENTS = 16  # a row's per-segment histograms are summed as one [16, 256] tile


_POW2 = {  # (block, split_block: the select packs two counts of a step into one int32)
    "block": (32, 16384),
    "split_block": (32, 16384),
    "num_warps": (1, 32),
    "bisect_cap": (1, 64),
    "bisect_warps": (1, 32),
    "split_chunk": (32, 32768),
    "split_warps": (1, 32),
    "split_cap": (1, 64),
    "split_list_warps": (1, 32),
    "split_sample": (1, 4096),
    "split_sample_warps": (1, 32),
}


def _topk_config(config) -> dict:
    """:data:`TOPK_CONFIG` updated by ``config`` (a mapping or None), every key checked (``ValueError``
    naming it: an unknown key, a wrong type or a value out of range). Without ``config`` the checked
    defaults are reused while :data:`TOPK_CONFIG` holds the same items (the checks cost ~9 µs of
    host time a call)."""
    if config is None:
        return dict(_checked_defaults(tuple(TOPK_CONFIG.items())))
    return _check_topk_config(config)


@functools.lru_cache(maxsize=1)
def _checked_defaults(items: tuple) -> dict:
    """:func:`_check_topk_config` of the defaults, once per content of :data:`TOPK_CONFIG` (``items``,
    the cache key; the caller copies the result)."""
    return _check_topk_config(None)


def _check_topk_config(config) -> dict:
    """:func:`_topk_config` without the cache."""
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config: expected a dict or None, got {type(config).__name__}")
    extra = {"profile": 0, "bisect_vec_load": False}  # (timing and experiments; not in the defaults)
    unknown = sorted(set(config or {}) - set(TOPK_CONFIG) - set(extra))
    if unknown:
        raise ValueError(f"config: unknown key(s) {unknown}; known: {sorted({*TOPK_CONFIG, *extra})}")
    cfg = {**TOPK_CONFIG, **extra, **(config or {})}
    for key, v in cfg.items():
        want_bool = key in ("bisect_pack16", "bisect_vec_load")
        if isinstance(v, bool) != want_bool or not isinstance(v, int):
            raise ValueError(f"config: {key} must be {'a bool' if want_bool else 'an int'}, got {v!r}")
    for key, (lo, hi) in _POW2.items():
        v = cfg[key]
        if not lo <= v <= hi or v & (v - 1):
            raise ValueError(f"config: {key} must be a power of two from {lo} to {hi}, got {v!r}")
    checks = (
        ("bits", cfg["bits"] in (1, 2, 4, 8, 16), "must divide 32 (a power of two up to 16)"),
        ("compact", cfg["compact"] >= 0, "must be >= 0 (0 = off)"),
        ("compact", not cfg["compact"] or cfg["bits"] == 8, "needs 8-bit digits (bits=8)"),
        ("hist_bits", cfg["hist_bits"] in (4, 8), "must be 4 or 8"),
        ("programs_per_sm", 1 <= cfg["programs_per_sm"] <= 64, "must be from 1 to 64"),
        ("final_warps", cfg["final_warps"] in (0, 1, 2, 4, 8, 16, 32), "must be 0 (num_warps) or a power of two up to 32"),
        ("bisect", 0 <= cfg["bisect"] <= 32768, "must be from 0 (never) to 32768"),
        ("split", cfg["split"] >= 0, "must be >= 0 (0 = never)"),
        ("bisect_maxnreg", cfg["bisect_maxnreg"] == 0 or 16 <= cfg["bisect_maxnreg"] <= 255, "must be 0 (the compiler's) or from 16 to 255"),
        ("profile", cfg["profile"] in (0, 1, 2, 3, 4), "must be 0 (off) or a timing stop 1-4 (the radix path has 1-2; more acts as 2)"),
    )  # fmt: skip
    for key, ok, what in checks:
        if not ok:
            raise ValueError(f"config: {key} {what}, got {cfg[key]!r}")
    return cfg


def _check_topk_launch(logits, lo, hi, out, k, kk, table, page_block_size, next_n) -> None:
    """``launch_topk``'s tensors and sizes as its docstring states them (``ValueError``/``TypeError``
    naming the argument): what the kernels read and write must lie inside them."""
    check_tensor_arg(logits, "logits", (torch.float32, torch.float16, torch.bfloat16), 2)
    rows, n = logits.shape
    if logits.stride(1) != 1 and n > 1:
        raise ValueError(f"logits: entries must be contiguous (stride(1) == 1), got strides {tuple(logits.stride())}")
    for name, v, lo_v in (("k", k, 1), ("kk", kk, 1), ("next_n", next_n, 1), ("page_block_size", page_block_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo_v:
            raise ValueError(f"{name}: expected an int >= {lo_v}, got {v!r}")
    if kk != min(k, n):  # (n == 0 has nothing to select: the caller fills out with -1)
        raise ValueError(f"kk: expected min(k, n) = {min(k, n)}, got {kk}")
    check_tensor_arg(out, "out", (torch.int32,), 2)
    if tuple(out.shape) != (rows, k) or (k > 1 and out.stride(1) != 1) or out.device != logits.device:
        raise ValueError(f"out: expected [{rows}, {k}] int32 with contiguous entries on {logits.device}, got "
                         f"{list(out.shape)} strides {tuple(out.stride())} on {out.device}")  # fmt: skip
    for name, t in (("lo", lo), ("hi", hi)):
        if t is not None:
            check_tensor_arg(t, name, (torch.int32, torch.int64), 1)
            if t.shape[0] != rows or (rows > 1 and t.stride(0) != 1) or t.device != logits.device:
                raise ValueError(
                    f"{name}: expected [{rows}] contiguous on {logits.device}, got {list(t.shape)} on {t.device}"
                )
    if table is not None:
        check_tensor_arg(table, "table", (torch.int32, torch.int64), 2)
        if rows % next_n or table.shape[0] != rows // next_n or (table.shape[1] > 1 and table.stride(1) != 1):
            raise ValueError(f"table: expected [rows / next_n = {rows / next_n}, max_blocks] with contiguous "
                             f"entries, got {list(table.shape)} strides {tuple(table.stride())}")  # fmt: skip
        if table.device != logits.device:
            raise ValueError(f"table: expected on {logits.device}, got {table.device}")
    check_no_self_overlap(out, "out")
    check_apart(out, "out", (logits, lo, hi, table))


def _launch_topk_split(logits, lo, hi, out, scratch, k, k_p2, n_p2, bt, slots, page_block_size, next_n, ordered, cfg):
    """The split path's three launches (:func:`_topk_threshold_kernel`, :func:`_topk_split_pos_kernel`,
    :func:`_topk_list_kernel`, which also does the rows it flags); returns the rows' flags ``[rows]``
    int32 (1: the sample misjudged the row; for tests and benchmarks)."""
    rows, n = logits.shape
    sw, lw = 32 * cfg["split_warps"], 32 * cfg["split_list_warps"]
    chunk = max(min(cfg["split_chunk"], n_p2), sw)
    nch = cdiv(n, chunk)
    cap = max(min(n_p2, k_p2 * cfg["split_cap"]), lw)  # (powers of two: a multiple of lw)
    sample = min(cfg["split_sample"], cap)
    groups = min(64, sample)
    rk = torch.empty((rows, nch * chunk), dtype=torch.int64, device=logits.device)  # (written sparsely)
    ws = torch.empty(rows * (nch + 2), dtype=torch.int32, device=logits.device)
    cnt = ws[: rows * nch].view(rows, nch)
    thr, flags = ws[rows * nch :].view(2, rows)
    pdl = pdl_enabled(logits.device)
    dep = {"launch_pdl": True} if pdl else {}
    launch_kernel(
        _topk_threshold_kernel, (rows, 1, 1), (logits, logits.stride(0), lo, hi, thr, n, k),
        dict(CAP=cap, SAMPLE_G=groups, SAMPLE_L=sample // groups, END=20, PDL=pdl), {"num_warps": cfg["split_sample_warps"]},
    )  # fmt: skip
    launch_kernel(
        _topk_split_pos_kernel, (rows, nch, 1),
        (logits, logits.stride(0), lo, hi, thr, rk, rk.stride(0), cnt, cnt.stride(0), n),
        dict(CHUNK=chunk, THREADS=sw, PDL=pdl), {"num_warps": cfg["split_warps"], **dep},
    )  # fmt: skip
    launch_kernel(
        _topk_list_kernel, (rows, 1, 1),
        (logits, logits.stride(0), lo, hi, rk, rk.stride(0), cnt, cnt.stride(0), flags, scratch, scratch.stride(0),
         out, out.stride(0), n, k,
         bt, bt.stride(0) if slots else 0, bt.shape[1] if slots else 0, page_block_size, next_n),
        dict(NCH=nch, CHUNK=chunk, CAP=cap, THREADS=lw, TIE_BITS=n_p2.bit_length() - 1, N_P2=n_p2, K_P2=k_p2,
             SLOTS=slots, SORTED=bool(ordered), STOP=0, PDL=pdl, BLOCK=min(cfg["block"], 1024),
             FOR_LOOP=not interpreting()),
        {"num_warps": cfg["split_list_warps"], **dep},
    )  # fmt: skip
    return flags


def launch_topk(
    logits, lo, hi, out, k, kk, table=None, page_block_size=1, next_n=1, config=None, ordered=True, *, _checked=False
) -> None:
    """``logits [rows, n]`` (row stride any, entries contiguous), ``lo``/``hi`` ``[rows]`` int32 or
    int64 (clamped to ``[0, n]`` here) or None (every row from 0 / to ``n``: no tensors to fill),
    ``out [rows, k]`` int32 (entries contiguous): each row's ``min(k, hi - lo)`` best positions in
    rank order (``ordered``; else in no set order) and ``-1`` after them, in columns
    ``< next_power_of_2(kk)`` (``kk = min(k, n)``; the caller fills any column past that). With ``table`` (``[b, max_blocks]`` int32/int64, entries
    contiguous, ``b = rows / next_n``) the positions become cache slots as
    :func:`sparse_mla.kvcache.reference.abs_indices_to_kvcache_indices` maps them. ``_checked``: the
    caller (:func:`sparse_mla.indexer.topk._topk`) has checked the tensors and made ``out`` and ``kk``
    itself, so they are not checked again (~12 µs of host time a call)."""
    cfg = _topk_config(config)
    if not _checked:
        _check_topk_launch(logits, lo, hi, out, k, kk, table, page_block_size, next_n)
    require_runnable(
        _topk_kernel, logits.device, _key32, _row_chunk, _cand_chunk, _chunk, _digit_hist, _pick_digit,
        _radix_pass, _radix_kth, _select_pass, _split_keys, _select_keys, table_slots, _row_bounds, _seg_steps, _seg_pick, _levels_pick,
        _topk_hist_kernel, _topk_split_kernel, _emit_topk, _topk_bisect_kernel, _bisect_down, _column_slots, _rank_keys,
        _scalar_positions, _bisect_down16, _f16x2_ge, _f16x2_add, _f16x2_lanes, _pair_lanes, _bisect_packed,
        _finish_from_list, _list_or_select, _load_keys, _finish_keys, _topk_threshold_kernel, _topk_split_pos_kernel,
        _topk_list_kernel, _max_pair, _unrank,
    )  # fmt: skip
    rows, n = logits.shape
    if rows == 0:
        return
    cap = cfg["compact"]
    if n == 1 and (lo is None or hi is None):  # (Triton compiles n == 1 as a constant; a row of constant
        # bounds then fails its coalesce pass, so such rows get range tensors)
        z = torch.zeros(rows, dtype=torch.int32, device=logits.device)
        lo, hi = (z if lo is None else lo), (z + 1 if hi is None else hi)
    k_p2 = next_pow2(kk)
    block = min(cfg["block"], max(next_pow2(n), 256))
    slots = table is not None
    bt = table if slots else out  # (a placeholder when there is no table: never read)
    for_loop = not interpreting()
    n_p2 = next_pow2(n)
    if n_p2 <= cfg["bisect"]:  # the row fits in one program's registers
        warps = min(cfg["bisect_warps"], max(4, n_p2 // 2048))
        vec = 4 if cfg["bisect_vec_load"] else 1
        n_p2 = max(n_p2, 32 * warps * vec)  # every thread holds an entry (a vector)
        if cfg["split"] and n >= cfg["split"]:  # the split path (its list kernel also does the rows it flags)
            scratch = torch.empty((rows, k_p2), dtype=torch.int64, device=logits.device)
            _launch_topk_split(logits, lo, hi, out, scratch, k, k_p2, n_p2, bt, slots, page_block_size, next_n,
                               ordered, cfg)  # fmt: skip
            return
        cap = min(n_p2, max(k_p2 * cfg["bisect_cap"], k_p2, 32 * warps))
        ws = torch.empty((rows, k_p2 + cap), dtype=torch.int64, device=logits.device)
        scratch, cand = ws[:, :k_p2], ws[:, k_p2:]
        # (through the direct launcher, as the split path's three launches: each ~20-30 µs of host
        # time through Triton's own path)
        launch_kernel(
            _topk_bisect_kernel, (rows, 1, 1),
            (logits, logits.stride(0), lo, hi, scratch, scratch.stride(0), out, out.stride(0), n, k,
             bt, bt.stride(0) if slots else 0, bt.shape[1] if slots else 0, page_block_size, next_n,
             cand, cand.stride(0)),
            dict(N_P2=n_p2, BLOCK=block, K_P2=k_p2, CAP=cap, THREADS=32 * warps, TIE_BITS=n_p2.bit_length() - 1,
                 SLOTS=slots, SORTED=bool(ordered), FOR_LOOP=for_loop, STOP=cfg["profile"], VEC=vec,
                 PACK16=cfg["bisect_pack16"] and vec == 1 and n_p2 >= 64 * warps,
                 INSIDE=0 if vec != 1 else (n_p2 if n == n_p2 else n_p2 // 2 if 2 * n > n_p2 else 0) // (32 * warps)),
            {"num_warps": warps,
             **({"maxnreg": cfg["bisect_maxnreg"]} if cfg["bisect_maxnreg"] and not interpreting() else {})},
        )  # fmt: skip
        return
    hb = cfg["hist_bits"]
    per, n_seg = 1, 1
    if cap:  # segments of `per` steps: about programs_per_sm programs per SM, at most _MAX_SEGMENTS a row
        n_blk = cdiv(n, block)
        per, n_seg = _split(n_blk, rows, cfg["programs_per_sm"] * _num_sms(logits.device, None))
        if n_seg > _MAX_SEGMENTS:
            per = cdiv(n_blk, _MAX_SEGMENTS)
            n_seg = cdiv(n_blk, per)
    n_hist = rows * (16 // hb) * n_seg * (1 << hb) if cap else 0
    # one allocation: scratch [rows, k_p2] int64, candidate lists [rows, cap] int64, histograms int32
    ws = torch.empty(rows * (k_p2 + cap) + n_hist // 2, dtype=torch.int64, device=logits.device)
    scratch = ws[: rows * k_p2].view(rows, k_p2)
    cand, hist, s_p2 = scratch, scratch, 1
    if cap:  # the histogram levels and the split, each over (rows, segments) programs
        s_p2 = next_pow2(n_seg)
        cand = ws[rows * k_p2 : rows * (k_p2 + cap)].view(rows, cap)
        hist = ws[rows * (k_p2 + cap) :].view(torch.int32).view(rows, 16 // hb, n_seg, 1 << hb)
        meta = dict(HB=hb, S_P2=s_p2, FOR_LOOP=for_loop, num_warps=cfg["num_warps"])
        args = (logits, logits.stride(0), lo, hi, hist, hist.stride(0))
        for level in range(16 // hb):
            _topk_hist_kernel[(rows, n_seg)](*args, n, k, n_seg, per * block, LEVEL=level, BLOCK=block, **meta)
        split_block = min(cfg["split_block"], block)
        _topk_split_kernel[(rows, n_seg)](
            *args, scratch, scratch.stride(0), cand, cand.stride(0), n, k, n_seg, per * block, cap,
            BLOCK=split_block, **meta,
        )  # fmt: skip
    _topk_kernel[(rows,)](
        logits, logits.stride(0), lo, hi, scratch, scratch.stride(0), out, out.stride(0), n, k,
        bt, bt.stride(0) if slots else 0, bt.shape[1] if slots else 0, page_block_size, next_n,
        cand, cand.stride(0), cap, hist, hist.stride(0), n_seg,
        BLOCK=block, BITS=cfg["bits"], K_P2=k_p2, SLOTS=slots, FOR_LOOP=for_loop, COMPACT=cap > 0, S_P2=s_p2,
        HB=hb, PROFILE=cfg["profile"], SORTED=bool(ordered),
        num_warps=(cfg["final_warps"] if cap else 0) or cfg["num_warps"],
    )  # fmt: skip
