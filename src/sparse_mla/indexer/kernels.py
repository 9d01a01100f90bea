"""Triton ``tl`` kernels of the indexer and their launchers (any GPU Triton supports; the CPU
under the interpreter). Twins: :mod:`sparse_mla.indexer.reference`. Imported on first use."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..decode.portable import dot_consts
from ..runtime import interpreting, require_runnable
from ..serving.store import _e4m3_rtne_bits, ceil_log2_div448
from .checks import index_cache_geometry

__all__ = ["launch_quant_store", "launch_mqa_logits", "launch_paged_mqa_logits"]


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
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_n = toks < n
    slot = tl.load(slot_ptr + toks.to(tl.int64) * stride_slot, mask=in_n, other=-1).to(tl.int64)
    valid = in_n & (slot >= 0) & (slot < num_slots)
    safe = tl.where(valid, slot, 0)
    blk = safe // bs
    off = safe - blk * bs
    base = blk * stride_blk
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
    q8 = _e4m3_rtne_bits(y)
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
    require_runnable(_index_quant_store_kernel, kv_cache.device, _e4m3_rtne_bits, ceil_log2_div448)
    nb, bs, _, stride_blk = index_cache_geometry(kv_cache)
    n = k.shape[0]
    block_t = 16
    _index_quant_store_kernel[(triton.cdiv(n, block_t),)](
        k, k.stride(0), slot_mapping, slot_mapping.stride(0), kv_cache, stride_blk, bs, nb * bs, n,
        D=d, UE8M0=ue8m0, BLOCK_T=block_t,
    )  # fmt: skip


@triton.jit
def _weighted_relu_rows(
    q, k, sc, w, ROWS: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr
):
    """``Σ_h w[r, h] · relu((q[r, h] · k[j]) · sc[j])`` for ``q [ROWS * H_P2, D]``, ``k [BLOCK_N, D]``,
    ``sc [BLOCK_N]``, ``w [ROWS, H_P2]`` -> ``[ROWS, BLOCK_N]`` fp32."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    s = tl.maximum(s * sc[None, :], 0.0)
    return tl.sum(tl.reshape(s, [ROWS, H_P2, BLOCK_N]) * w[:, :, None], axis=1)


@triton.jit
def _mqa_logits_kernel(
    q_ptr,
    stride_qs,
    stride_qh,
    kv_ptr,
    stride_kv,
    scale_ptr,
    w_ptr,
    stride_ws,
    stride_wh,
    ks_ptr,
    ke_ptr,
    out_ptr,
    stride_os,
    s_q,
    s_kv,
    H,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    H_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Grid ``(ceil(s_q / BLOCK_M), ceil(s_kv / BLOCK_N))``: BLOCK_M query tokens x BLOCK_N keys; a
    tile outside every row's ``[ks, ke)`` only writes -inf."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < s_q
    cmask = cols < s_kv
    ks = tl.load(ks_ptr + rows, mask=rmask, other=0)
    ke = tl.load(ke_ptr + rows, mask=rmask, other=0)
    inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None]) & cmask[None, :]
    logits = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    if tl.max(tl.max(inside.to(tl.int32), axis=1), axis=0) > 0:
        hh = tl.arange(0, H_P2)
        dd = tl.arange(0, D)
        qm = rmask[:, None] & (hh[None, :] < H)
        qoff = tl.reshape(rows.to(tl.int64)[:, None] * stride_qs + hh[None, :] * stride_qh, [BLOCK_M * H_P2])
        q8 = tl.load(q_ptr + qoff[:, None] + dd[None, :], mask=tl.reshape(qm, [BLOCK_M * H_P2])[:, None], other=0)
        q = q8.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
        k8 = tl.load(kv_ptr + cols.to(tl.int64)[:, None] * stride_kv + dd[None, :], mask=cmask[:, None], other=0)
        k = k8.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
        sc = tl.load(scale_ptr + cols, mask=cmask, other=0.0)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_ws + hh[None, :] * stride_wh, mask=qm, other=0.0)
        lg = _weighted_relu_rows(q, k, sc, w, BLOCK_M, H_P2, BLOCK_N, DOT_PREC)
        logits = tl.where(inside, lg, float("-inf"))
    optr = out_ptr + rows.to(tl.int64)[:, None] * stride_os + cols[None, :]
    tl.store(optr, logits, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr,
    stride_qb,
    stride_qn,
    stride_qh,
    cache_ptr,
    stride_blk,
    bs,
    nb,
    w_ptr,
    stride_wr,
    stride_wh,
    ctx_ptr,
    bt_ptr,
    stride_btb,
    max_blocks,
    out_ptr,
    stride_or,
    max_ctx,
    next_n,
    H,
    D: tl.constexpr,
    NN_P2: tl.constexpr,
    H_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Grid ``(b, ceil(max_context_len / BLOCK_N))``: all ``next_n`` query positions of request ``i``
    against BLOCK_N keys of its context (each key read once for the request)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pp = tl.arange(0, NN_P2)
    ctx = tl.load(ctx_ptr + i)
    logits = tl.full([NN_P2, BLOCK_N], float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_N < ctx:
        page = cols // bs
        pmask = (cols < ctx) & (page < max_blocks)
        blk = tl.load(bt_ptr + i.to(tl.int64) * stride_btb + page, mask=pmask, other=-1)
        okk = pmask & (blk >= 0) & (blk < nb)
        base = tl.where(okk, blk, 0).to(tl.int64) * stride_blk
        off = (cols - page * bs).to(tl.int64)
        dd = tl.arange(0, D)
        k8 = tl.load(cache_ptr + base[:, None] + off[:, None] * D + dd[None, :], mask=okk[:, None], other=0)
        k = k8.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
        sc = tl.load((cache_ptr + base + bs * D + off * 4).to(tl.pointer_type(tl.float32)), mask=okk, other=0.0)
        hh = tl.arange(0, H_P2)
        qm = (pp[:, None] < next_n) & (hh[None, :] < H)
        qoff = tl.reshape(pp[:, None] * stride_qn + hh[None, :] * stride_qh, [NN_P2 * H_P2])
        qb = q_ptr + i.to(tl.int64) * stride_qb
        q8 = tl.load(qb + qoff[:, None] + dd[None, :], mask=tl.reshape(qm, [NN_P2 * H_P2])[:, None], other=0)
        q = q8.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
        wrow = (i * next_n + pp).to(tl.int64)
        w = tl.load(w_ptr + wrow[:, None] * stride_wr + hh[None, :] * stride_wh, mask=qm, other=0.0)
        lg = _weighted_relu_rows(q, k, sc, w, NN_P2, H_P2, BLOCK_N, DOT_PREC)
        visible = okk[None, :] & (cols[None, :] <= ctx - next_n + pp[:, None])
        logits = tl.where(visible, lg, float("-inf"))
    orow = (i * next_n + pp).to(tl.int64)
    tl.store(
        out_ptr + orow[:, None] * stride_or + cols[None, :],
        logits,
        mask=(pp[:, None] < next_n) & (cols[None, :] < max_ctx),
    )


def launch_mqa_logits(q, kv, kv_scale, weights, ks, ke, out) -> None:
    """``q [s_q, H, D]`` and ``kv [s_kv, D]`` as uint8 (e4m3 bytes); ``out [s_q, s_kv]`` fp32."""
    require_runnable(_mqa_logits_kernel, q.device, _weighted_relu_rows)
    s_q, h, d = q.shape
    s_kv = kv.shape[0]
    h_p2 = max(triton.next_power_of_2(h), 16)  # a dot needs >= 16 rows
    block_m = max(1, 128 // h_p2)
    block_n = 64
    grid = (triton.cdiv(s_q, block_m), triton.cdiv(s_kv, block_n))
    _mqa_logits_kernel[grid](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), kv_scale, weights, weights.stride(0), weights.stride(1),
        ks, ke, out, out.stride(0), s_q, s_kv, h,
        D=d, BLOCK_M=block_m, H_P2=h_p2, BLOCK_N=block_n, **dot_consts(interpreting(), loop=False), num_warps=4,
    )  # fmt: skip


def launch_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, out, max_context_len) -> None:
    """``q [b, next_n, H, D]`` uint8 (e4m3 bytes); ``out [b * next_n, max_context_len]`` fp32."""
    require_runnable(_paged_mqa_logits_kernel, q.device, _weighted_relu_rows)
    b, next_n, h, d = q.shape
    nb, bs, _, stride_blk = index_cache_geometry(kv_cache)
    block_n = 64
    grid = (b, triton.cdiv(max_context_len, block_n))
    _paged_mqa_logits_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2), kv_cache, stride_blk, bs, nb, weights, weights.stride(0),
        weights.stride(1), context_lens, block_table, block_table.stride(0), block_table.shape[1], out,
        out.stride(0), max_context_len, next_n, h,
        D=d, NN_P2=triton.next_power_of_2(next_n), H_P2=max(triton.next_power_of_2(h), 16), BLOCK_N=block_n,
        **dot_consts(interpreting(), loop=False), num_warps=4,
    )  # fmt: skip
