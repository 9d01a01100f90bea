"""The consumer of the Hopper kernel's narrow 16/32-head tiles (h_q <= 32: tensor-parallel slices):
one warpgroup with the block's 64 tokens on the wgmmas' M and the heads on their N (see the
package doc)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from .common import D_NOPE, _cta_barrier, partition_row, request_blocks, stage_q, store_out_staged, tile_ptrs

__all__ = ["consumer_narrow"]


@gluon.jit
def consumer_narrow(
    q,
    sink_ptr,
    sched,
    out,
    lse,
    o_acc,
    lse_acc,
    max_logits,
    scale_log2,
    h_q,
    q_smem,
    qr_smem,
    p_smem,
    ring,
    KV_BF16: gl.constexpr,
    IS_V32: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr,
    ROWSUM_PER_THREAD: gl.constexpr,
    STAGED_OUT: gl.constexpr = False,
):
    """The consumer of 16- or 32-head tiles (one warpgroup): the block's 64 tokens are the wgmmas' M and the
    ``HEADS`` heads their N, ``Sᵀ = K Qᵀ [64, HEADS]`` and ``Oᵀ += Vᵀ Pᵀ [512, HEADS]``, so no MMA row
    is a padded head; the softmax reduces along the tokens (axis 0)."""
    q_ptr, stride_qb, stride_qs, stride_qh = q
    _meta_ptr, nsplit_ptr, _mainblk_ptr, _nblk_ptr = sched
    lse_ptr, stride_lb, stride_lh, stride_ls = lse
    lacc_ptr, stride_lr, stride_lsq = lse_acc
    ml_ptr, stride_mlb, stride_mlh = max_logits
    k_smem, kr_smem, mask_smem, ready_bars, empty_bars = ring
    NS: gl.constexpr = k_smem.shape[0]  # ring stages (of 64 tokens: the tokens are the wgmmas' M)
    HEADS: gl.constexpr = q_smem.shape[0]
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEADS, 16])
    SROW: gl.constexpr = gl.SliceLayout(1, S_L)  # tokens
    SCOL: gl.constexpr = gl.SliceLayout(0, S_L)  # heads
    OROW: gl.constexpr = gl.SliceLayout(1, S_L)  # output columns (same distributed layout, M = 512)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    sq = gl.program_id(1)
    hb = gl.program_id(2)
    prow = partition_row(sched[0])
    begin_req, end_req, begin_split = prow[0], prow[1], prow[4]

    heads = hb * HEADS + gl.arange(0, HEADS, layout=SCOL)
    hmask = heads < h_q
    hmask_o = gl.expand_dims(hmask, 0)
    cols_o = gl.arange(0, D_NOPE, layout=OROW)
    qr = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, QL))
    qc = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    qmask = gl.expand_dims(qr < h_q, 1)
    if HAS_SINK:
        sink_log2 = gl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634

    it = 0
    req = begin_req
    while req <= end_req:
        blk0, blk1 = request_blocks(sched, prow, req, HAS_EXTRA)
        split = gl.where(req == begin_req, begin_split, 0)
        split_base = gl.load(nsplit_ptr + req)
        n_splits = gl.load(nsplit_ptr + req + 1) - split_base

        qbase = q_ptr + req.to(gl.int64) * stride_qb + sq * stride_qs
        stage_q(q_smem, qr_smem, qbase + gl.expand_dims(qr.to(gl.int64) * stride_qh, 1) + gl.expand_dims(qc, 0),
                qmask, IS_V32)  # fmt: skip

        m_i = gl.full([HEADS], float("-inf"), gl.float32, SCOL)
        # ROWSUM_PER_THREAD (HopperConfig.narrow_rowsum): the row sums stay per thread (each
        # thread's tokens of every head) and are reduced across the warpgroup once, after the last
        # block: one cross-warp reduction a block less
        if ROWSUM_PER_THREAD:
            l_part = gl.zeros([64, HEADS], gl.float32, S_L)
        else:
            l_i = gl.zeros([HEADS], gl.float32, SCOL)
        acc = gl.zeros([D_NOPE, HEADS], gl.float32, S_L)
        for _blk in range(blk0, blk1):
            stage = it % NS
            phase = (it // NS) & 1
            mbarrier.wait(ready_bars.index(stage), phase)
            if KV_BF16:
                # the stage was written by cp.async (generic proxy) and is read by wgmma (async
                # proxy); the writers cannot fence after their copies land, so the reader does
                fence_async_shared()
            kbuf = k_smem.index(stage)
            s = warpgroup_mma(kbuf, q_smem.permute([1, 0]), gl.zeros([64, HEADS], gl.float32, S_L), use_acc=False)
            if IS_V32:
                s = warpgroup_mma(kr_smem.index(stage), qr_smem.permute([1, 0]), s)
            bias = mask_smem.index(stage).load(SROW)
            s = gl.where(gl.expand_dims(bias, 1) == 0.0, s * scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - gl.expand_dims(m_safe, 0))
            if ROWSUM_PER_THREAD:
                l_part = l_part * gl.expand_dims(alpha, 0) + p
            else:
                l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            acc = acc * gl.expand_dims(alpha, 0)
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            _cta_barrier()
            acc = warpgroup_mma(kbuf.permute([1, 0]), p_smem, acc)
            _cta_barrier()
            mbarrier.arrive(empty_bars.index(stage), count=1)
            it += 1

        if ROWSUM_PER_THREAD:
            l_i = gl.sum(l_part, axis=0)
        lonely = l_i == 0.0
        l_safe = gl.where(lonely, 1.0, l_i)
        m_safe2 = gl.where(lonely, 0.0, m_i)
        lse2 = gl.where(lonely, float("-inf"), gl.log2(l_safe) + m_safe2)
        if n_splits <= 1:
            denom = l_safe
            if HAS_SINK:
                denom += gl.exp2(sink_log2 - m_safe2)
            scale_col = gl.where(lonely, 0.0, 1.0 / denom)
            o = acc * gl.expand_dims(scale_col, 0)
            if STAGED_OUT:  # Oᵀ through the Q tile (store_out_staged; this warpgroup stages the next Q itself)
                store_out_staged(o.to(gl.bfloat16), q_smem, out, req, sq, hb * HEADS, h_q, 0, True)
            else:
                optr = tile_ptrs(out, req.to(gl.int64), sq, gl.expand_dims(heads, 0), gl.expand_dims(cols_o, 1))
                gl.store(optr, o.to(gl.bfloat16), mask=hmask_o)
            lse_v = gl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
            gl.store(lse_ptr + req.to(gl.int64) * stride_lb + heads * stride_lh + sq * stride_ls, lse_v, mask=hmask)
            if HAS_MAX_LOGITS:
                gl.store(
                    ml_ptr + req.to(gl.int64) * stride_mlb + heads * stride_mlh,
                    gl.where((l_i != l_i) & (m_i != float("inf")), float("nan"), m_i * 0.6931471805599453),
                    mask=hmask,
                )
        else:
            row = (split_base + split).to(gl.int64)
            o = acc * gl.expand_dims(1.0 / l_safe, 0)
            aptr = tile_ptrs(o_acc, row, sq, gl.expand_dims(heads, 0), gl.expand_dims(cols_o, 1))
            gl.store(aptr, o, mask=hmask_o)
            gl.store(lacc_ptr + row * stride_lr + sq * stride_lsq + heads, lse2, mask=hmask)
        req += 1
