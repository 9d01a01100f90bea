"""Portable backward kernel of the sparse prefill in Triton ``tl`` and its launcher: any GPU Triton
supports, and the CPU under Triton's interpreter. Twin:
:func:`sparse_mla.training.reference.sparse_prefill_backward_reference`.

One program serves one query token and ``BLOCK_H`` of its heads (grid ``(s_q, ceil(h_q /
BLOCK_H))``), as the forward kernel does. It holds ``q``, ``dO``, ``D = rowsum(dO ∘ out)`` and
``lse' = logaddexp(lse, sink)`` of its heads and walks the token's valid top-k list ``BLOCK_N``
indices a step: gathers the rows (bf16, masked loads: invalid and unattended rows are never read),
recomputes ``P = exp2(q·k·sm_scale·log2(e) − lse'·log2(e))``, forms ``dS = P ∘ (dO·Vᵀ − D)``,
accumulates ``dq += dS·K`` in registers and adds ``dK = dSᵀ·q·sm_scale`` (576 or 512 columns) plus
``Pᵀ·dO`` (the first 512) into a float32 ``dkv`` buffer with fp32 atomics (keys listed by several
queries, by several head tiles or twice in one list each add their share; the sum is race-free but
its rounding order is not fixed from run to run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.env import LOG2E, cdiv, require_runnable
from ...core.launcher import launch_fitting
from ...core.target import device_target
from ...formats.gather import dot_consts

__all__ = ["launch", "BLOCK_N"]

BLOCK_N = 32  # indices per step
#: heads per program, tried in order until the variant fits the GPU's shared memory. A 64-head
#: tile (q, dO and dq of 64 heads x 576 columns) wants ~300 KB at any BLOCK_N, more than any GPU
#: has (sm_90a: 227 KB); 32 heads take 135 KB (sm_90a, sm_100a), 16 heads ~100 KB (sm_86/89/120).
#: Each head tile gathers the rows again and adds its own share into dkv.
_HEAD_TILES = (32, 16)
_HEAD_TILE_REFUSED: set = set()  # ((device, target, constexprs, warps), head tile) refused for shared memory


@triton.jit
def _bwd_step(
    q_main,
    q_tail,
    do,
    delta,
    lse2,
    dq_main,
    dq_tail,
    kv_rows,
    sel,
    dkv,
    i,
    pos0,
    n_valid,
    scale_log2,
    sm_scale,
    IS_V32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One BLOCK_N-index step: returns the updated ``(dq_main, dq_tail)`` (unscaled) and adds the
    step's ``dK`` rows into ``dkv``."""
    kv_ptr, stride_kv, s_kv = kv_rows
    idx_ptr, stride_iq, stride_it, len_ptr = sel
    dkv_ptr, stride_dkv = dkv
    offs = pos0 + tl.arange(0, BLOCK_N)
    in_list = offs < n_valid
    idx = tl.load(idx_ptr + i.to(tl.int64) * stride_iq + offs * stride_it, mask=in_list, other=-1)
    valid = in_list & (idx >= 0) & (idx < s_kv)
    safe = tl.where(valid, idx, 0).to(tl.int64)
    row = kv_ptr + safe * stride_kv
    cm = tl.arange(0, 512)
    ct = tl.arange(0, 64)
    k_main = tl.load(row[:, None] + cm[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PREC)
    if IS_V32:
        k_tail = tl.load(row[:, None] + 512 + ct[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=DOT_PREC)
    p = tl.where(valid[None, :], tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(k_main), input_precision=DOT_PREC)
    ds = tl.where(valid[None, :], p * (dp - delta[:, None]), 0.0)
    ds_c = ds.to(DOT_DTYPE)
    dq_main = tl.dot(ds_c, k_main, acc=dq_main, input_precision=DOT_PREC)
    dk_main = tl.dot(tl.trans(ds_c), q_main, input_precision=DOT_PREC) * sm_scale
    dk_main = tl.dot(tl.trans(p.to(DOT_DTYPE)), do, acc=dk_main, input_precision=DOT_PREC)
    drow = dkv_ptr + safe * stride_dkv
    tl.atomic_add(drow[:, None] + cm[None, :], dk_main, mask=valid[:, None], sem="relaxed")
    if IS_V32:
        dq_tail = tl.dot(ds_c, k_tail, acc=dq_tail, input_precision=DOT_PREC)
        dk_tail = tl.dot(tl.trans(ds_c), q_tail, input_precision=DOT_PREC) * sm_scale
        tl.atomic_add(drow[:, None] + 512 + ct[None, :], dk_tail, mask=valid[:, None], sem="relaxed")
    return dq_main, dq_tail


@triton.jit
def _sparse_prefill_bwd_kernel(
    q,
    do,
    kv_rows,
    sel,
    stats,
    dq,
    dkv,
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
    """Grid ``(s_q, ceil(h_q / BLOCK_H))``. ``q``, ``do``, ``dq`` as ``(ptr, stride_s, stride_h)``;
    ``kv_rows = (ptr, row_stride, s_kv)``; ``sel = (indices_ptr, stride_s, stride_t,
    topk_length_ptr)``; ``stats = (delta_ptr, lse2_ptr)``, contiguous ``[s_q, h_q]`` fp32 (``lse2``
    is ``lse'`` in log2 units); ``dkv = (ptr, row_stride)`` fp32."""
    q_ptr, stride_qs, stride_qh = q
    do_ptr, stride_ds, stride_dh = do
    dq_ptr, stride_gs, stride_gh = dq
    _idx_ptr, _sis, _sit, len_ptr = sel
    delta_ptr, lse2_ptr = stats
    i = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    cm = tl.arange(0, 512)
    ct = tl.arange(0, 64)
    qrow = q_ptr + i.to(tl.int64) * stride_qs + heads.to(tl.int64)[:, None] * stride_qh
    q_main = tl.load(qrow + cm[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    if IS_V32:
        q_tail = tl.load(qrow + 512 + ct[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    else:
        q_tail = tl.zeros([BLOCK_H, 64], dtype=DOT_DTYPE)
    dorow = do_ptr + i.to(tl.int64) * stride_ds + heads.to(tl.int64)[:, None] * stride_dh
    do_t = tl.load(dorow + cm[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    srow = i.to(tl.int64) * h_q + heads
    delta = tl.load(delta_ptr + srow, mask=hmask, other=0.0)
    lse2 = tl.load(lse2_ptr + srow, mask=hmask, other=float("inf"))
    n_valid = topk
    if HAS_TOPK_LEN:
        n_valid = tl.maximum(tl.minimum(tl.load(len_ptr + i), topk), 0)
    n_steps = tl.cdiv(n_valid, BLOCK_N)

    dq_main = tl.zeros([BLOCK_H, 512], tl.float32)
    dq_tail = tl.zeros([BLOCK_H, 64], tl.float32)
    if FOR_LOOP:
        for step in tl.range(0, n_steps, num_stages=NUM_STAGES):
            dq_main, dq_tail = _bwd_step(
                q_main, q_tail, do_t, delta, lse2, dq_main, dq_tail, kv_rows, sel, dkv, i, step * BLOCK_N,
                n_valid, scale_log2, sm_scale, IS_V32, BLOCK_N, DOT_DTYPE, DOT_PREC,
            )  # fmt: skip
    else:  # interpreter (its range() cannot take loaded bounds with NumPy >= 2.4)
        step = 0
        while step < n_steps:
            dq_main, dq_tail = _bwd_step(
                q_main, q_tail, do_t, delta, lse2, dq_main, dq_tail, kv_rows, sel, dkv, i, step * BLOCK_N,
                n_valid, scale_log2, sm_scale, IS_V32, BLOCK_N, DOT_DTYPE, DOT_PREC,
            )  # fmt: skip
            step += 1

    grow = dq_ptr + i.to(tl.int64) * stride_gs + heads.to(tl.int64)[:, None] * stride_gh
    tl.store(grow + cm[None, :], (dq_main * sm_scale).to(dq_ptr.dtype.element_ty), mask=hmask[:, None])
    if IS_V32:
        tl.store(grow + 512 + ct[None, :], (dq_tail * sm_scale).to(dq_ptr.dtype.element_ty), mask=hmask[:, None])


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
    require_runnable(_sparse_prefill_bwd_kernel, q.device, _bwd_step)
    s_q, h_q, d_qk = q.shape
    dev = q.device
    dq = torch.empty(s_q, h_q, d_qk, dtype=torch.float32, device=dev)
    dkv = torch.zeros(kv.shape[0], d_qk, dtype=torch.float32, device=dev)
    lse2 = (lse_eff * LOG2E).contiguous()
    consts = dict(
        IS_V32=d_qk == 576,
        BLOCK_N=BLOCK_N,
        HAS_TOPK_LEN=topk_length is not None,
        **dot_consts(device_target(dev)),
    )
    args = (
        (q, q.stride(0), q.stride(1)),
        (dout, dout.stride(0), dout.stride(1)),
        (kv, kv.stride(0), kv.shape[0]),
        (indices, indices.stride(0), indices.stride(2), topk_length if topk_length is not None else indices),
        (delta, lse2),
        (dq, dq.stride(0), dq.stride(1)),
        (dkv, dkv.stride(0)),
        h_q,
        indices.shape[2],
        sm_scale * LOG2E,
        sm_scale,
    )
    key = (dev, device_target(dev).name, tuple(consts.items()), num_warps)
    # (the smallest tile is never marked refused: its refusal is raised)
    tiles = _HEAD_TILES if h_q > _HEAD_TILES[-1] else _HEAD_TILES[-1:]
    for block_h in [t for t in tiles if (key, t) not in _HEAD_TILE_REFUSED]:
        try:
            launch_fitting(
                _sparse_prefill_bwd_kernel, (s_q, cdiv(h_q, block_h), 1), args, {**consts, "BLOCK_H": block_h},
                num_warps, num_stages, (*key[:3], block_h), shrink=("BLOCK_N", 16),
            )  # fmt: skip
            break
        except triton.runtime.errors.OutOfResources:
            if block_h == tiles[-1]:
                raise
            _HEAD_TILE_REFUSED.add((key, block_h))
    return dq, dkv
