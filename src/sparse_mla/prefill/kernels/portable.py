"""Portable sparse prefill kernel in Triton ``tl`` and its launcher: any GPU Triton supports, and
the CPU under Triton's interpreter. Twin: :func:`sparse_mla.prefill.reference.sparse_prefill_reference`.

One program serves one query token and ``BLOCK_H`` of its heads (grid ``(s_q, ceil(h_q /
BLOCK_H))``): it walks the token's valid top-k list ``BLOCK_N`` indices a step, gathers the rows
(bf16 ``kv`` rows, or FP8 cache records dequantised by the decode kernel's gather,
:func:`sparse_mla.decode.kernels.portable.load_block_keys`), computes ``QKᵀ`` over ``d_qk``, runs an
online softmax in exp2 space with the running max as the reference point (so the row max is
also ``max_logits``) and accumulates ``P·V`` over ``d_v = 512`` in fp32. No split-KV: a query
token's top-k is one program's loop. Invalid keys are never loaded (masked loads, 0 as the fill
value), so NaN in unattended rows cannot reach the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.env import LOG2E, cdiv, interpreting, require_runnable
from ...core.launcher import launch_fitting
from ...core.target import device_target
from ...decode.kernels.combine import final_out_lse
from ...decode.scheduler import small_head_tile
from ...formats.gather import ADDR_GENERAL, cache_args, dot_consts, gather_consts, load_block_keys
from ..problem import PrefillProblem

__all__ = ["launch", "BLOCK_N"]

BLOCK_N = 64  # indices per step


@triton.jit
def _load_bf16_keys(
    kv_bf16, sel, i, pos0, n_valid, IS_V32: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr
):
    """Gather BLOCK_N indexed rows of a bf16 ``kv``: (k_main [N, 512], k_tail [N, 64], valid [N])."""
    kv_ptr, stride_kv, s_kv = kv_bf16
    idx_ptr, stride_iq, _stride_ik, stride_it, _topk, _len_ptr = sel
    offs = pos0 + tl.arange(0, BLOCK_N)
    in_list = offs < n_valid
    idx = tl.load(idx_ptr + i * stride_iq + offs * stride_it, mask=in_list, other=-1)
    valid = in_list & (idx >= 0) & (idx < s_kv)
    row = kv_ptr + tl.where(valid, idx, 0).to(tl.int64) * stride_kv
    k_main = tl.load(row[:, None] + tl.arange(0, 512)[None, :], mask=valid[:, None], other=0.0)
    if IS_V32:
        k_tail = tl.load(row[:, None] + 512 + tl.arange(0, 64)[None, :], mask=valid[:, None], other=0.0)
    else:
        k_tail = tl.zeros([BLOCK_N, 64], dtype=tl.bfloat16)
    return k_main.to(DOT_DTYPE), k_tail.to(DOT_DTYPE), valid


@triton.jit
def max_logits_out(m_i, l_i):
    """``max_logits`` in natural units from the running max ``m_i`` (of ``q·k · sm_scale · log2(e)``)
    and softmax sum ``l_i``, by :func:`.reference.max_logits_rule`: the max skips NaN scores, and a
    NaN (or ``+inf``) score turns ``l_i`` NaN, so a NaN sum under a max below ``+inf`` means NaN."""
    nan = (l_i != l_i) & (m_i != float("inf"))
    return tl.where(nan, float("nan"), m_i * 0.6931471805599453)


@triton.jit
def _prefill_step(
    q_main,
    q_tail,
    m_i,
    l_i,
    acc,
    kv_bf16,
    cache,
    sel,
    i,
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
):
    """One BLOCK_N-index step of the online softmax; returns the updated (m, l, acc)."""
    if KV_FP8:
        k_main, k_tail, valid = load_block_keys(
            cache,
            sel,
            i,
            0,
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
        )
    else:
        k_main, k_tail, valid = _load_bf16_keys(kv_bf16, sel, i, pos0, n_valid, IS_V32, BLOCK_N, DOT_DTYPE)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PREC)
    if IS_V32:
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=DOT_PREC)
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(DOT_DTYPE), k_main, acc=acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _sparse_prefill_kernel(
    q,
    kv_bf16,
    cache,
    sel,
    sink_ptr,
    out,
    max_logits,
    lse,
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
    HAS_TOPK_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FP8_HW: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Grid ``(s_q, ceil(h_q / BLOCK_H))``. ``q = (ptr, stride_s, stride_h)``; ``kv_bf16 = (ptr,
    row_stride, s_kv)`` (bf16 form); ``cache`` as the decode kernel's (FP8 form); ``sel =
    (indices_ptr, stride_s, stride_kv_head, stride_t, topk, topk_length_ptr)``; ``out``,
    ``max_logits``, ``lse`` as ``(ptr, stride_s, stride_h)``."""
    q_ptr, stride_qs, stride_qh = q
    _idx_ptr, _sis, _sik, _sit, topk, len_ptr = sel
    out_ptr, stride_os, stride_oh = out
    ml_ptr, stride_ms, stride_mh = max_logits
    lse_ptr, stride_ls, stride_lh = lse
    i = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    cm = tl.arange(0, 512)
    qrow = q_ptr + i.to(tl.int64) * stride_qs + heads.to(tl.int64)[:, None] * stride_qh
    q_main = tl.load(qrow + cm[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    if IS_V32:
        q_tail = tl.load(qrow + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    else:
        q_tail = tl.zeros([BLOCK_H, 64], dtype=DOT_DTYPE)
    sink_log2 = tl.zeros([BLOCK_H], tl.float32)
    if HAS_SINK:
        sink_log2 = tl.load(sink_ptr + heads, mask=hmask, other=float("-inf")) * 1.4426950408889634
    n_valid = topk
    if HAS_TOPK_LEN:
        n_valid = tl.maximum(tl.minimum(tl.load(len_ptr + i), topk), 0)
    n_steps = tl.cdiv(n_valid, BLOCK_N)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    if FOR_LOOP:
        for step in tl.range(0, n_steps, num_stages=NUM_STAGES):
            m_i, l_i, acc = _prefill_step(
                q_main, q_tail, m_i, l_i, acc, kv_bf16, cache, sel, i, step * BLOCK_N, n_valid, scale_log2,
                KV_FP8, ADDR, IS_V32, D_NOPE, TILE, MAIN_TILES, NUM_TILES, BLOCK_N, DOT_DTYPE, DOT_PREC, FP8_HW,
            )  # fmt: skip
    else:  # interpreter (its range() cannot take loaded bounds with NumPy >= 2.4)
        step = 0
        while step < n_steps:
            m_i, l_i, acc = _prefill_step(
                q_main, q_tail, m_i, l_i, acc, kv_bf16, cache, sel, i, step * BLOCK_N, n_valid, scale_log2,
                KV_FP8, ADDR, IS_V32, D_NOPE, TILE, MAIN_TILES, NUM_TILES, BLOCK_N, DOT_DTYPE, DOT_PREC, FP8_HW,
            )  # fmt: skip
            step += 1

    o, lse_v = final_out_lse(acc, l_i, m_i, sink_log2, HAS_SINK)
    ml = max_logits_out(m_i, l_i)
    tl.store(
        out_ptr + i.to(tl.int64) * stride_os + heads[:, None] * stride_oh + cm[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )
    tl.store(ml_ptr + i.to(tl.int64) * stride_ms + heads * stride_mh, ml, mask=hmask)
    tl.store(lse_ptr + i.to(tl.int64) * stride_ls + heads * stride_lh, lse_v, mask=hmask)


def launch(
    p: PrefillProblem, num_warps: int = 8, num_stages: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the portable prefill kernel on a validated, non-empty problem.

    Returns:
        ``out [s_q, h_q, 512]`` bf16, ``max_logits [s_q, h_q]`` fp32, ``lse [s_q, h_q]`` fp32.
    """
    require_runnable(_sparse_prefill_kernel, p.q.device, final_out_lse, load_block_keys)
    q = p.q
    s_q, h_q, _ = q.shape
    dev = q.device
    interp = interpreting()
    # Triton 3.6's interpreter truncates fp32 -> bf16 instead of rounding: write fp32 there, round once
    out = torch.empty(s_q, h_q, p.d_v, dtype=torch.float32 if interp else torch.bfloat16, device=dev)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=dev)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=dev)
    lay = p.layout
    is_v32 = lay.name == "V32"
    if p.kv_fp8:
        cache, addr = cache_args(p.kv, is_v32)
        kv_bf16 = (q, 0, 0)  # never read
    else:
        cache, addr = (q, 0, 0, 0, 1, 0), ADDR_GENERAL.value  # never read
        kv_bf16 = (p.kv, p.kv.stride(0), p.kv.shape[0])
    ix = p.indices
    sel = (ix, *ix.stride(), ix.shape[2], p.topk_length if p.topk_length is not None else ix)
    block_h = small_head_tile(h_q)
    args = (
        (q, q.stride(0), q.stride(1)),
        kv_bf16,
        cache,
        sel,
        p.attn_sink if p.attn_sink is not None else lse,
        (out, out.stride(0), out.stride(1)),
        (max_logits, max_logits.stride(0), max_logits.stride(1)),
        (lse, lse.stride(0), lse.stride(1)),
        h_q,
        p.sm_scale * LOG2E,
    )
    consts = dict(
        KV_FP8=p.kv_fp8,
        ADDR=addr,
        IS_V32=is_v32,
        **gather_consts(lay),
        BLOCK_H=block_h,
        BLOCK_N=BLOCK_N,
        HAS_TOPK_LEN=p.topk_length is not None,
        HAS_SINK=p.attn_sink is not None,
        **dot_consts(device_target(dev)),
    )
    grid = (s_q, cdiv(h_q, block_h), 1)
    launch_fitting(
        _sparse_prefill_kernel, grid, args, consts, num_warps, num_stages, (dev, tuple(consts.items())),
        shrink=("BLOCK_N", 16),  # ~100 KB of shared memory (sm_86/89/120): 32 or 16 indices a step
    )  # fmt: skip
    return out.to(torch.bfloat16) if interp else out, max_logits, lse
