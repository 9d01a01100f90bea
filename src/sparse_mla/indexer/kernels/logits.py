"""The indexer's multi-query logits: a contiguous key buffer (prefill, :func:`launch_mqa_logits`)
or the paged key cache (decode, :func:`launch_paged_mqa_logits`; keys gathered by ``cp.async``, or
on sm_90+ brought by tensor-memory copies). Twins: :func:`sparse_mla.indexer.reference.fp8_mqa_logits_reference`,
:func:`sparse_mla.indexer.reference.fp8_paged_mqa_logits_reference`.

Both logits kernels compute a tile as ``S = K @ Q^T`` with the keys as the M side (BLOCK_N tokens,
a [tokens, D] tile, D contiguous) and the query rows of one program (positions x heads, D
contiguous) as the N side: both operands K-major, which Hopper's FP8 wgmma needs. The sum over
heads is then a sum along the accumulator's columns (in-thread adds and a few lane shuffles, no
shared memory), the key scale is per accumulator row and the head weight per column.
On sm_89+ (and in the interpreter) the operands are float8e4nv with fp32 accumulation; on older
GPUs (no e4m3 type) the bytes are decoded to fp16 by integer operations (exact) and the dot is
fp16 x fp16 -> fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...core.env import cdiv, interpreting, next_pow2, require_runnable
from ...core.fp8 import e4m3_decode_exact
from ...core.target import device_target
from ..problem import index_cache_geometry
from .common import resolve_config, sm_count, split_work

__all__ = [
    "PrefillConfig",
    "PagedConfig",
    "PREFILL_CONFIG",
    "PAGED_CONFIG",
    "launch_mqa_logits",
    "launch_paged_mqa_logits",
    "fp8_dot_supported",
    "tma_supported",
]


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
    query, w_ptr, stride_wr, stride_wh, ctx_ptr, bt_ptr, stride_btb, out_ptr, stride_or, max_ctx, next_n, H,
    tiles_per_prog,
    D: tl.constexpr, P: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """What a paged-logits program of grid ``(b, chunks, ceil(next_n / P))`` works on: request
    ``pid0``'s context length, its query positions ``pp`` (``[pid2 * P, ...)``), the ``P * H_P2``
    query rows (``qm1`` live) as the dot's ``Qᵀ``, their weights, output rows and row mask, the
    block-table row, and the key tiles ``[t_lo, t_mid)`` inside the context and ``[t_mid, t_hi)``
    past it (-inf only). ``query``: ``(q_ptr, stride_qb, stride_qn, stride_qh)``."""
    q_ptr, stride_qb, stride_qn, stride_qh = query
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
    query, cache_ptr, stride_blk, bs, nb, w_ptr, stride_wr, stride_wh,
    ctx_ptr, bt_ptr, stride_btb, max_blocks, out_ptr, stride_or, max_ctx, next_n, H, tiles_per_prog,
    D: tl.constexpr, P: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    FOR_LOOP: tl.constexpr, NUM_STAGES: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """Grid ``(b, chunks, ceil(next_n / P))``: request ``pid0``'s query positions ``[pid2 * P, ...)``
    (``P * H_P2`` dot rows, loaded once) against its key tiles ``[pid1 * tiles_per_prog, ...)``,
    BLOCK_N keys a step (each key read once per request when ``P >= next_n``), the next tiles'
    gathers in flight (``NUM_STAGES``); tiles past the context only filled with -inf. ``query``:
    ``(q_ptr, stride_qb, stride_qn, stride_qh)``, the queries ``[b, next_n, H, D]``."""
    ctx, pp, qm1, q_t, w, out_rows, row_mask, bt_row, t_lo, t_mid, t_hi = _paged_program(
        query, w_ptr, stride_wr, stride_wh, ctx_ptr, bt_ptr, stride_btb, out_ptr, stride_or, max_ctx, next_n, H,
        tiles_per_prog, D, P, H_P2, BLOCK_N, FP8_DOT, DOT_DTYPE,
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
    query, k_desc, s_desc, bs, nb, w_ptr, stride_wr, stride_wh,
    ctx_ptr, bt_ptr, stride_btb, max_blocks, out_ptr, stride_or, max_ctx, next_n, H, tiles_per_prog,
    D: tl.constexpr, P: tl.constexpr, H_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    FOR_LOOP: tl.constexpr, NUM_STAGES: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """``_paged_mqa_logits_kernel`` on Hopper with e4m3 dots and keys brought by tensor-memory
    copies (``_paged_tma_tile``): no address registers, the copies in flight ``NUM_STAGES`` deep."""
    ctx, pp, qm1, q_t, w, out_rows, row_mask, bt_row, t_lo, t_mid, t_hi = _paged_program(
        query, w_ptr, stride_wr, stride_wh, ctx_ptr, bt_ptr, stride_btb, out_ptr, stride_or, max_ctx, next_n, H,
        tiles_per_prog, D, P, H_P2, BLOCK_N, True, tl.float16,
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


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of :func:`launch_mqa_logits`: ``block_n`` keys per step, ``rows`` dot rows
    per program (query tokens x heads, padded to powers of two), ``num_warps``, ``num_stages`` (key
    tiles in flight), ``progs_per_sm`` programs to aim for per SM (the key range is split until
    there are that many), ``fp8_dot``: e4m3 tensor-core dots (None: by device, sm_89+)."""

    block_n: int = 128
    rows: int = 128
    num_warps: int = 8
    num_stages: int = 3
    progs_per_sm: int = 4
    fp8_dot: bool | None = None


@dataclass(frozen=True)
class PagedConfig:
    """Launch parameters of :func:`launch_paged_mqa_logits`: as :class:`PrefillConfig` (``rows``:
    query positions x heads), with ``num_warps`` None = 4, or 8 for more than 128 dot rows (64
    without e4m3 dots: fp16 spills on sm_80). The tensor-memory path (``tma``: None = where the
    device has it, sm_90+) has its own ``tma_stages`` (copies in flight: about half the stages),
    ``tma_progs_per_sm`` and ``tma_maxnreg`` (a register cap, 0 = the compiler's choice; 168: 3
    programs of 4 warps per SM, measured on the H200 at 219 µs against 291 at the compiler's 180
    registers and 16 programs per SM)."""

    block_n: int = 64
    rows: int = 256
    num_warps: int | None = None
    num_stages: int = 4
    progs_per_sm: int = 16
    fp8_dot: bool | None = None
    tma: bool | None = None
    tma_stages: int = 8
    tma_progs_per_sm: int = 8
    tma_maxnreg: int = 168


#: the defaults (``benchmarks/indexer_sweep.py`` times others, passed as ``config``)
PREFILL_CONFIG = PrefillConfig()
PAGED_CONFIG = PagedConfig()


def tma_supported(device: torch.device) -> bool:
    """Whether ``device`` has the tensor-memory accelerator (its target's ``tma``: CUDA sm_90+; not
    under the interpreter)."""
    return device_target(device).tma


def _paged_descriptors(kv_cache, nb, bs, d, stride_blk, block_n, meta, cfg):
    """``(keys, scales)`` tensor descriptors of the paged kernel's copies, or None where the
    tensor-memory path does not apply: not asked for (``cfg.tma`` False; None = where the device
    has it), no e4m3 dots, a tile that would straddle pages (``block_size % block_n``), or a
    start, block stride or scale offset that is not a multiple of 16 bytes (the copies' rule)."""
    want = cfg.tma
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
    """Whether the logits kernels take e4m3 tensor-core dots on ``device`` by default: its target's
    ``fp8_dot`` (compiled on CUDA sm_89+; AMD, older NVIDIA GPUs and the interpreter: the exact
    integer e4m3 decode). The interpreter: Triton 3.6-3.9 read e4m3 NaN bytes as +-480 inside its
    FP8 dots, so CPU calls take the integer decode (tests still run the FP8 path there by asking)."""
    return device_target(device).fp8_dot


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


def paged_warps(cfg: PagedConfig, dot_rows: int, fp8_dot: bool) -> int:
    """The paged kernel's warps: ``cfg.num_warps``, or by default 4, and two warpgroups for more
    than 128 dot rows (64 fp16 rows: spills on sm_80)."""
    if cfg.num_warps is not None:
        return cfg.num_warps
    return 8 if dot_rows > (128 if fp8_dot else 64) else 4


def launch_mqa_logits(q, kv, kv_scale, weights, ks, ke, out, num_sms=None, config=None) -> None:
    """``q [s_q, H, D]`` and ``kv [s_kv, D]`` as uint8 (e4m3 bytes); ``out [s_q, s_kv]`` fp32.
    ``config``: a :class:`PrefillConfig`, a dict of its fields to change, or None (the default)."""
    require_runnable(_mqa_logits_kernel, q.device, _e4m3_operand, e4m3_decode_exact, _head_sum, _mqa_tile, _fill_tile)
    cfg = resolve_config(config, PREFILL_CONFIG)
    s_q, h, d = q.shape
    s_kv = kv.shape[0]
    bq, h_p2 = _rows_tile(h, s_q, cfg.rows)
    block_n = cfg.block_n
    n_qb = cdiv(s_q, bq)
    per, splits = split_work(cdiv(s_kv, block_n), n_qb, sm_count(q.device, num_sms) * cfg.progs_per_sm)
    _mqa_logits_kernel[(n_qb, splits)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), kv_scale, weights, weights.stride(0), weights.stride(1),
        ks, ke, out, out.stride(0), s_q, s_kv, h, per,
        D=d, BQ=bq, H_P2=h_p2, BLOCK_N=block_n, **_dot_meta(q.device, cfg.fp8_dot, d), HEAD_PAD=h < h_p2,
        NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip


def launch_paged_mqa_logits(
    q, kv_cache, weights, context_lens, block_table, out, max_context_len, num_sms=None, config=None
) -> None:
    """``q [b, next_n, H, D]`` uint8 (e4m3 bytes); ``out [b * next_n, max_context_len]`` fp32;
    ``num_sms`` sizes the grid (default: the device's). ``config``: a :class:`PagedConfig`, a dict
    of its fields to change, or None (the default)."""
    require_runnable(
        _paged_mqa_logits_kernel, q.device, _e4m3_operand, e4m3_decode_exact, _head_sum, _paged_tile, _fill_tile,
        _paged_program, _paged_tma_tile, _paged_tma_logits_kernel,
    )  # fmt: skip
    cfg = resolve_config(config, PAGED_CONFIG)
    b, next_n, h, d = q.shape
    nb, bs, _, stride_blk = index_cache_geometry(kv_cache)
    p, h_p2 = _rows_tile(h, next_n, cfg.rows)
    groups = cdiv(next_n, p)
    block_n = cfg.block_n
    meta = _dot_meta(q.device, cfg.fp8_dot, d)
    warps = paged_warps(cfg, p * h_p2, meta["FP8_DOT"])
    descs = _paged_descriptors(kv_cache, nb, bs, d, stride_blk, block_n, meta, cfg)
    pps = cfg.progs_per_sm if descs is None else cfg.tma_progs_per_sm
    per, chunks = split_work(cdiv(max_context_len, block_n), b * groups, sm_count(q.device, num_sms) * pps)
    query = (q, q.stride(0), q.stride(1), q.stride(2))
    if descs is not None:
        extra = {"maxnreg": cfg.tma_maxnreg} if cfg.tma_maxnreg and not interpreting() else {}
        _paged_tma_logits_kernel[(b, chunks, groups)](
            query, *descs, bs, nb, weights, weights.stride(0), weights.stride(1),
            context_lens, block_table, block_table.stride(0), block_table.shape[1], out, out.stride(0),
            max_context_len, next_n, h, per,
            D=d, P=p, H_P2=h_p2, BLOCK_N=block_n, HEAD_PAD=h < h_p2, NUM_STAGES=cfg.tma_stages,
            FOR_LOOP=meta["FOR_LOOP"], num_warps=warps,
            **extra,
        )  # fmt: skip
        return
    _paged_mqa_logits_kernel[(b, chunks, groups)](
        query, kv_cache, stride_blk, bs, nb, weights, weights.stride(0),
        weights.stride(1), context_lens, block_table, block_table.stride(0), block_table.shape[1], out,
        out.stride(0), max_context_len, next_n, h, per,
        D=d, P=p, H_P2=h_p2, BLOCK_N=block_n, **meta, HEAD_PAD=h < h_p2,
        NUM_STAGES=cfg.num_stages, num_warps=warps,
    )  # fmt: skip
