"""Portable backward kernel of the sparse prefill in Triton ``tl`` and its launcher: any GPU Triton
supports, and the CPU under Triton's interpreter. Twin:
:func:`sparse_mla.training.reference.sparse_prefill_backward_reference`.

Two kernels, so that no program holds both a query's ``dq`` and a row block's ``dK``, and every
dot is wgmma-sized on sm_90a (64 rows on its M side):

* ``dq``: one program per query token and ``BLOCK_H`` (32) of its heads (grid ``(s_q, ceil(h_q /
  BLOCK_H))``), as the forward kernel. It holds ``q``, ``dO``, ``D = rowsum(dO ∘ out)`` and ``lse'
  = logaddexp(lse, sink)`` of its heads and walks the token's valid top-k list ``BLOCK_N`` rows a
  step: gathers the rows (bf16, masked loads: invalid and unattended rows are never read),
  recomputes ``P = exp2(q·k·sm_scale·log2(e) − lse'·log2(e))``, forms ``dS = P ∘ (dO·Vᵀ − D)``
  and accumulates ``dq += dS·K`` in registers.
* ``dkv``: one program per query token and ``BLOCK_N`` positions of its list (grid ``(s_q ·
  ceil(topk / BLOCK_N),)``). It gathers its rows once, walks the token's heads ``BLOCK_H`` a step
  (recomputing ``Pᵀ`` and ``dSᵀ`` of those heads) and sums ``dSᵀ·q·sm_scale`` (576 or 512
  columns) plus ``Pᵀ·dO`` (the first 512) over every head in registers, then adds the rows into a
  float32 ``dkv`` buffer with one fp32 atomic add per (query, listed row, column): keys listed by
  several queries or twice in one list each add their share; the sum is race-free but its
  rounding order is not fixed from run to run.

Each (query, head, listed row) score is computed twice, once per kernel: 3.5x the forward's
FLOPs (the forward's two products, ``dP`` twice, ``dq``, ``dK``, ``dV``) in exchange for 4.8 G atomic
adds at s_q 4096, topk 2048, d_qk 576 instead of one per head tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.env import LOG2E, cdiv, next_pow2, require_runnable
from ...core.launcher import launch_fitting
from ...core.target import device_target
from ...formats.gather import dot_consts

__all__ = ["launch", "BLOCK_N"]

#: key rows a step of the ``dq`` kernel
BLOCK_N = 64
#: key rows per ``dkv`` program: 64 (the wgmma M side) where the dots are wgmma / tcgen05
#: (sm_90a, sm_100a), else 32 (its ``[512, rows]`` fp32 sum in registers: 64 rows spill 4-10 KB a
#: thread with mma.sync, compiled offline for sm_80 / sm_86)
DKV_ROWS = {"sm_90a": 64, "sm_100a": 64}
DKV_ROWS_ELSE = 32
#: heads per ``dq`` program, tried in order until the variant fits the GPU's shared memory (16 for
#: ~100 KB GPUs): the heads are the products' N side, so 32 keeps them wgmma-sized; 32 took 87.0
#: ms against 90.1 for 64 (H100, s_q 4096, h_q 128, topk 2048, the whole backward)
_HEAD_TILES = (32, 16)
_HEAD_TILE_REFUSED: set = set()  # ((device, target, constexprs, warps), head tile) refused for shared memory
#: heads per step of the ``dkv`` program (halved, down to 16, where shared memory is short)
DKV_HEADS = 32


@triton.jit
def _gather_rows(kv_rows, sel, i, pos0, n_valid, IS_V32: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Query ``i``'s list positions ``[pos0, pos0 + BLOCK_N)``: ``(k_main [BLOCK_N, 512], k_tail
    [BLOCK_N, 64], valid [BLOCK_N], row index [BLOCK_N] int64)``; rows not read (invalid, past
    ``n_valid``) are zeros and index 0."""
    kv_ptr, stride_kv, s_kv = kv_rows
    idx_ptr, stride_iq, stride_it, _len_ptr = sel
    offs = pos0 + tl.arange(0, BLOCK_N)
    in_list = offs < n_valid
    idx = tl.load(idx_ptr + i.to(tl.int64) * stride_iq + offs * stride_it, mask=in_list, other=-1)
    valid = in_list & (idx >= 0) & (idx < s_kv)
    safe = tl.where(valid, idx, 0).to(tl.int64)
    row = kv_ptr + safe * stride_kv
    k_main = tl.load(row[:, None] + tl.arange(0, 512)[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
    if IS_V32:
        k_tail = tl.load(row[:, None] + 512 + tl.arange(0, 64)[None, :], mask=valid[:, None], other=0.0)
        k_tail = k_tail.to(DOT_DTYPE)
    else:
        k_tail = tl.zeros([BLOCK_N, 64], dtype=DOT_DTYPE)
    return k_main, k_tail, valid, safe


@triton.jit
def _head_rows(q, do, stats, i, heads, hmask, h_q, IS_V32: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Query ``i``'s rows of ``heads``: ``(q_main [H, 512], q_tail [H, 64], dO [H, 512], D [H],
    lse' [H] in log2 units)``; heads past ``h_q`` are zeros with ``lse' = +inf`` (P = 0)."""
    q_ptr, stride_qs, stride_qh = q
    do_ptr, stride_ds, stride_dh = do
    delta_ptr, lse2_ptr = stats
    cm = tl.arange(0, 512)
    ct = tl.arange(0, 64)
    qrow = q_ptr + i.to(tl.int64) * stride_qs + heads.to(tl.int64)[:, None] * stride_qh
    q_main = tl.load(qrow + cm[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    if IS_V32:
        q_tail = tl.load(qrow + 512 + ct[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    else:
        q_tail = tl.zeros([heads.shape[0], 64], dtype=DOT_DTYPE)
    dorow = do_ptr + i.to(tl.int64) * stride_ds + heads.to(tl.int64)[:, None] * stride_dh
    do_t = tl.load(dorow + cm[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    srow = i.to(tl.int64) * h_q + heads
    delta = tl.load(delta_ptr + srow, mask=hmask, other=0.0)
    lse2 = tl.load(lse2_ptr + srow, mask=hmask, other=float("inf"))
    return q_main, q_tail, do_t, delta, lse2


@triton.jit
def _valid_count(sel, i, topk, HAS_TOPK_LEN: tl.constexpr):
    """Positions of query ``i``'s list that count: ``clamp(topk_length[i], 0, topk)`` or ``topk``."""
    n_valid = topk
    if HAS_TOPK_LEN:
        n_valid = tl.maximum(tl.minimum(tl.load(sel[3] + i), topk), 0)
    return n_valid


@triton.jit
def _probs_t(k_main, k_tail, valid, q_main, q_tail, do_t, delta, lse2, scale_log2,
             IS_V32: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """``(Pᵀ, Pᵀ ∘ (dPᵀ − D))`` of rows × heads, fp32, recomputed from the scores: every product
    has the rows on its M side and the heads on N, and no product's result is another's first
    operand (Triton then gives each its own warp layout; a chained first operand makes it put every
    warp on M, wgmma-sized at 128 rows, and a 64-row product would be computed twice)."""
    st = tl.dot(k_main, tl.trans(q_main), input_precision=DOT_PREC)
    if IS_V32:
        st = tl.dot(k_tail, tl.trans(q_tail), acc=st, input_precision=DOT_PREC)
    pt = tl.where(valid[:, None], tl.exp2(st * scale_log2 - lse2[None, :]), 0.0)
    dpt = tl.dot(k_main, tl.trans(do_t), input_precision=DOT_PREC)
    return pt, pt * (dpt - delta[None, :])


@triton.jit
def _dq_step(q_main, q_tail, do_t, delta, lse2, dq_main, dq_tail, kv_rows, sel, i, pos0, n_valid, scale_log2,
             IS_V32: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """One BLOCK_N-position step of the ``dq`` program: the updated ``(dq_main [512, H], dq_tail
    [64, H])``, transposed (the heads on the products' N side) and unscaled."""
    k_main, k_tail, valid, _rows = _gather_rows(kv_rows, sel, i, pos0, n_valid, IS_V32, BLOCK_N, DOT_DTYPE)
    _pt, dst = _probs_t(k_main, k_tail, valid, q_main, q_tail, do_t, delta, lse2, scale_log2, IS_V32, DOT_PREC)
    dst = dst.to(DOT_DTYPE)
    dq_main = tl.dot(tl.trans(k_main), dst, acc=dq_main, input_precision=DOT_PREC)
    if IS_V32:
        dq_tail = tl.dot(tl.trans(k_tail), dst, acc=dq_tail, input_precision=DOT_PREC)
    return dq_main, dq_tail


@triton.jit
def _sparse_prefill_dq_kernel(
    q,
    do,
    kv_rows,
    sel,
    stats,
    dq,
    h_q,
    topk,
    scale_log2,
    sm_scale,
    IS_V32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FP8_HW: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Grid ``(s_q, ceil(h_q / BLOCK_H))``: ``dq`` of one query token's ``BLOCK_H`` heads.
    ``q``, ``do``, ``dq`` as ``(ptr, stride_s, stride_h)``; ``kv_rows = (ptr, row_stride, s_kv)``;
    ``sel = (indices_ptr, stride_s, stride_t, topk_length_ptr)``; ``stats = (delta_ptr,
    lse2_ptr)``, contiguous ``[s_q, h_q]`` fp32 (``lse2`` is ``lse'`` in log2 units)."""
    i = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    q_main, q_tail, do_t, delta, lse2 = _head_rows(q, do, stats, i, heads, hmask, h_q, IS_V32, DOT_DTYPE)
    n_valid = _valid_count(sel, i, topk, HAS_TOPK_LEN)
    n_steps = tl.cdiv(n_valid, BLOCK_N)
    dq_main = tl.zeros([512, BLOCK_H], tl.float32)  # transposed
    dq_tail = tl.zeros([64, BLOCK_H], tl.float32)
    if FOR_LOOP:
        for step in tl.range(0, n_steps, num_stages=NUM_STAGES):
            dq_main, dq_tail = _dq_step(
                q_main, q_tail, do_t, delta, lse2, dq_main, dq_tail, kv_rows, sel, i, step * BLOCK_N, n_valid,
                scale_log2, IS_V32, BLOCK_N, DOT_DTYPE, DOT_PREC,
            )  # fmt: skip
    else:  # interpreter (its range() cannot take loaded bounds with NumPy >= 2.4)
        step = 0
        while step < n_steps:
            dq_main, dq_tail = _dq_step(
                q_main, q_tail, do_t, delta, lse2, dq_main, dq_tail, kv_rows, sel, i, step * BLOCK_N, n_valid,
                scale_log2, IS_V32, BLOCK_N, DOT_DTYPE, DOT_PREC,
            )  # fmt: skip
            step += 1
    dq_ptr, stride_gs, stride_gh = dq
    gcol = dq_ptr + i.to(tl.int64) * stride_gs + heads.to(tl.int64)[None, :] * stride_gh
    main = (dq_main * sm_scale).to(dq_ptr.dtype.element_ty)
    tl.store(gcol + tl.arange(0, 512)[:, None], main, mask=hmask[None, :])
    if IS_V32:
        tail = (dq_tail * sm_scale).to(dq_ptr.dtype.element_ty)
        tl.store(gcol + 512 + tl.arange(0, 64)[:, None], tail, mask=hmask[None, :])


@triton.jit
def _dkv_heads(k_main, k_tail, valid, acc_main, acc_tail, q, do, stats, i, h0, h_q, scale_log2, sm_scale,
               IS_V32: tl.constexpr, BLOCK_H: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Heads ``[h0, h0 + BLOCK_H)`` of the ``dkv`` program: the rows' updated ``(acc_main [512,
    rows], acc_tail [64, rows])`` (transposed, as in :func:`_dq_step`) += ``qᵀ·dSᵀ·sm_scale`` (all
    576 or 512 columns) + ``dOᵀ·Pᵀ`` (the first 512)."""
    heads = h0 + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    q_main, q_tail, do_t, delta, lse2 = _head_rows(q, do, stats, i, heads, hmask, h_q, IS_V32, DOT_DTYPE)
    pt, dst = _probs_t(k_main, k_tail, valid, q_main, q_tail, do_t, delta, lse2, scale_log2, IS_V32, DOT_PREC)
    ds = tl.trans((dst * sm_scale).to(DOT_DTYPE))  # [heads, rows]
    acc_main = tl.dot(tl.trans(q_main), ds, acc=acc_main, input_precision=DOT_PREC)
    acc_main = tl.dot(tl.trans(do_t), tl.trans(pt.to(DOT_DTYPE)), acc=acc_main, input_precision=DOT_PREC)
    if IS_V32:
        acc_tail = tl.dot(tl.trans(q_tail), ds, acc=acc_tail, input_precision=DOT_PREC)
    return acc_main, acc_tail


@triton.jit
def _sparse_prefill_dkv_kernel(
    q,
    do,
    kv_rows,
    sel,
    stats,
    dkv,
    h_q,
    topk,
    n_row_blocks,
    scale_log2,
    sm_scale,
    IS_V32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FP8_HW: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Grid ``(s_q · n_row_blocks,)``, program ``i · n_row_blocks + j``: list positions ``[j ·
    BLOCK_N, (j + 1) · BLOCK_N)`` of query ``i``, every head (``BLOCK_H`` a step), summed over the
    heads in registers and added into ``dkv = (ptr, row_stride)`` (fp32) once: one atomic add per
    (query, listed row, column). The other arguments as :func:`_sparse_prefill_dq_kernel`'s."""
    pid = tl.program_id(0)
    i = pid // n_row_blocks
    pos0 = (pid % n_row_blocks) * BLOCK_N
    n_valid = _valid_count(sel, i, topk, HAS_TOPK_LEN)
    if pos0 < n_valid:
        k_main, k_tail, valid, rows = _gather_rows(kv_rows, sel, i, pos0, n_valid, IS_V32, BLOCK_N, DOT_DTYPE)
        acc_main = tl.zeros([512, BLOCK_N], tl.float32)  # transposed
        acc_tail = tl.zeros([64, BLOCK_N], tl.float32)
        n_steps = tl.cdiv(h_q, BLOCK_H)
        if FOR_LOOP:
            for step in tl.range(0, n_steps, num_stages=NUM_STAGES):
                acc_main, acc_tail = _dkv_heads(
                    k_main, k_tail, valid, acc_main, acc_tail, q, do, stats, i, step * BLOCK_H, h_q, scale_log2,
                    sm_scale, IS_V32, BLOCK_H, DOT_DTYPE, DOT_PREC,
                )  # fmt: skip
        else:
            step = 0
            while step < n_steps:
                acc_main, acc_tail = _dkv_heads(
                    k_main, k_tail, valid, acc_main, acc_tail, q, do, stats, i, step * BLOCK_H, h_q, scale_log2,
                    sm_scale, IS_V32, BLOCK_H, DOT_DTYPE, DOT_PREC,
                )  # fmt: skip
                step += 1
        dkv_ptr, stride_dkv = dkv
        dcol = dkv_ptr + rows[None, :] * stride_dkv
        tl.atomic_add(dcol + tl.arange(0, 512)[:, None], acc_main, mask=valid[None, :], sem="relaxed")
        if IS_V32:
            tl.atomic_add(dcol + 512 + tl.arange(0, 64)[:, None], acc_tail, mask=valid[None, :], sem="relaxed")


def launch(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    dout: torch.Tensor,
    delta: torch.Tensor,
    lse_eff: torch.Tensor,
    topk_length: torch.Tensor | None,
    num_warps: int = 8,
    num_stages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the backward kernel on validated, non-empty tensors.

    Args:
        q: ``[s_q, h_q, d_qk]`` bf16 (last dim contiguous); kv: ``[s_kv, 1, d_qk]`` bf16 rows
            (last dim contiguous); indices: ``[s_q, 1, topk]`` int32; sm_scale: softmax scale.
        dout: ``[s_q, h_q, 512]`` (last dim contiguous), the gradient of ``out``.
        delta: ``[s_q, h_q]`` fp32 contiguous, ``rowsum(dout ∘ out)``.
        lse_eff: ``[s_q, h_q]`` fp32 contiguous, ``logaddexp(lse, sink)`` (``lse`` without a sink).
        topk_length: ``[s_q]`` int32 contiguous or None.

    Returns:
        ``(dq [s_q, h_q, d_qk] float32, dkv [s_kv, d_qk] float32)``.
    """
    require_runnable(_sparse_prefill_dq_kernel, q.device, _dq_step, _gather_rows, _head_rows, _valid_count)
    require_runnable(_sparse_prefill_dkv_kernel, q.device, _dkv_heads, _probs_t)
    s_q, h_q, d_qk = q.shape
    dev = q.device
    target = device_target(dev)
    dq = torch.empty(s_q, h_q, d_qk, dtype=torch.float32, device=dev)
    dkv = torch.zeros(kv.shape[0], d_qk, dtype=torch.float32, device=dev)
    lse2 = (lse_eff * LOG2E).contiguous()
    topk = indices.shape[2]
    consts = dict(
        IS_V32=d_qk == 576,
        BLOCK_N=BLOCK_N,
        HAS_TOPK_LEN=topk_length is not None,
        **dot_consts(target),
    )
    heads_and_rows = (
        (q, q.stride(0), q.stride(1)),
        (dout, dout.stride(0), dout.stride(1)),
        (kv, kv.stride(0), kv.shape[0]),
        (indices, indices.stride(0), indices.stride(2), topk_length if topk_length is not None else indices),
        (delta, lse2),
    )
    key = (dev, target.name, tuple(consts.items()), num_warps)
    # dq: head tiles tried largest first (the smallest tile is never marked refused: its refusal is raised)
    args = (*heads_and_rows, (dq, dq.stride(0), dq.stride(1)), h_q, topk, sm_scale * LOG2E, sm_scale)
    tiles = [t for t in _HEAD_TILES if t < 2 * h_q or t == _HEAD_TILES[-1]]
    for block_h in [t for t in tiles if (key, t) not in _HEAD_TILE_REFUSED]:
        try:
            launch_fitting(
                _sparse_prefill_dq_kernel, (s_q, cdiv(h_q, block_h), 1), args, {**consts, "BLOCK_H": block_h},
                num_warps, num_stages, (*key[:3], block_h), shrink=("BLOCK_N", 16),
            )  # fmt: skip
            break
        except triton.runtime.errors.OutOfResources:
            if block_h == tiles[-1]:
                raise
            _HEAD_TILE_REFUSED.add((key, block_h))
    # dkv: BLOCK_N rows of one query a program, every head; the heads a step shrink where shared memory is short
    rows = DKV_ROWS.get(target.name, DKV_ROWS_ELSE)
    n_row_blocks = cdiv(topk, rows)
    args = (*heads_and_rows, (dkv, dkv.stride(0)), h_q, topk, n_row_blocks, sm_scale * LOG2E, sm_scale)
    launch_fitting(
        _sparse_prefill_dkv_kernel, (s_q * n_row_blocks, 1, 1), args,
        {**consts, "BLOCK_N": rows, "BLOCK_H": min(DKV_HEADS, max(16, next_pow2(h_q)))}, num_warps, num_stages, key,
        shrink=("BLOCK_H", 16),
    )  # fmt: skip
    return dq, dkv
