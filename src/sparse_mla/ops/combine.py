"""Combine kernel (seed step 16): LSE-weighted merge of the split-KV partial results.

For batch ``i`` with ``n = num_splits[i+1] - num_splits[i] > 1`` pieces, partial outputs
``o_j`` (each normalised by its own softmax sum) and log2-space LSEs ``lse_j``::

    m = max_j lse_j,  w_j = exp2(lse_j - m),  out = Σ w_j o_j / Σ w_j,  lse = (log2 Σ w_j + m) · ln 2

then ``attn_sink`` scales ``out`` by ``1 / (1 + exp2(sink·log2e - log2-lse))`` once, and a query
with no valid key anywhere (all ``lse_j = -inf``) gets ``out = 0``, ``lse = +inf``. Batches with
a single piece were finished by the decode kernel and are left alone.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(
    oacc_ptr, stride_ar, stride_as, stride_ah,
    lacc_ptr, stride_lr, stride_lsq,
    nsplit_ptr, sink_ptr,
    out_ptr, stride_ob, stride_os, stride_oh,
    lse_ptr, stride_lb, stride_lh, stride_ls,
    h_q,
    D_V: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SINK: tl.constexpr,
):
    req = tl.program_id(0)
    sq = tl.program_id(1)
    hb = tl.program_id(2)
    start = tl.load(nsplit_ptr + req)
    n = tl.load(nsplit_ptr + req + 1) - start
    if n > 1:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < h_q
        cols = tl.arange(0, D_V)
        lbase = lacc_ptr + sq * stride_lsq + heads
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        j = 0
        while j < n:  # (while, not range: Triton 3.6's interpreter breaks range() on NumPy >= 2.4)
            lj = tl.load(lbase + (start + j).to(tl.int64) * stride_lr, mask=hmask, other=float("-inf"))
            m = tl.maximum(m, lj)
            j += 1
        lonely = m == float("-inf")
        m_safe = tl.where(lonely, 0.0, m)
        tot = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D_V], tl.float32)
        j = 0
        while j < n:
            row = (start + j).to(tl.int64)
            lj = tl.load(lbase + row * stride_lr, mask=hmask, other=float("-inf"))
            w = tl.exp2(lj - m_safe)
            tot += w
            oj = tl.load(oacc_ptr + row * stride_ar + sq * stride_as + heads[:, None] * stride_ah + cols[None, :],
                         mask=hmask[:, None] & (w[:, None] > 0), other=0.0)
            acc += w[:, None] * oj
            j += 1
        tot_safe = tl.where(lonely, 1.0, tot)
        lse2 = tl.log2(tot_safe) + m_safe
        denom = tot_safe
        if HAS_SINK:
            sink_log2 = tl.load(sink_ptr + heads, mask=hmask, other=float("-inf")) * 1.4426950408889634
            denom += tl.exp2(sink_log2 - m_safe)
        o = tl.where(lonely[:, None], 0.0, acc / denom[:, None])
        tl.store(out_ptr + req * stride_ob + sq * stride_os + heads[:, None] * stride_oh + cols[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        lse = tl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
        tl.store(lse_ptr + req * stride_lb + heads * stride_lh + sq * stride_ls, lse, mask=hmask)


def combine_fwd(
    o_accum: torch.Tensor,
    lse_accum: torch.Tensor,
    num_splits: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_sink: Optional[torch.Tensor] = None,
) -> None:
    """Merge split partial results into ``out``/``lse`` in place (twin: ``reference.combine_reference``).

    Args:
        o_accum: ``[rows, s_q, h_q, d_v]`` fp32 partial outputs.
        lse_accum: ``[rows, s_q, h_q]`` fp32 log2-space partial LSEs.
        num_splits: ``[b + 1]`` int32 prefix sums of pieces per batch.
        out: ``[b, s_q, h_q, d_v]`` bf16 (or fp32) output, written for split batches only.
        lse: ``[b, h_q, s_q]`` fp32 natural-log LSE, written for split batches only.
        attn_sink: ``[h_q]`` fp32 or None.
    """
    b, s_q, h_q, d_v = out.shape
    block_h = 16
    grid = (b, s_q, triton.cdiv(h_q, block_h))
    _combine_kernel[grid](
        o_accum, o_accum.stride(0), o_accum.stride(1), o_accum.stride(2),
        lse_accum, lse_accum.stride(0), lse_accum.stride(1),
        num_splits, attn_sink if attn_sink is not None else lse_accum,
        out, out.stride(0), out.stride(1), out.stride(2),
        lse, lse.stride(0), lse.stride(1), lse.stride(2),
        h_q, D_V=d_v, BLOCK_H=block_h, HAS_SINK=attn_sink is not None,
        num_warps=4,
    )
