"""The consumers of the Hopper kernel's 64-head tiles, split by role: warpgroup 0
(:func:`consumer_qk`) computes ``S = Q Kᵀ``, runs the online softmax and does ``O[:, :256] += P V``;
warpgroup 1 (:func:`consumer_pv`) does ``O[:, 256:] += P V`` with the P and row factors handed over
through shared memory (see the package doc)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from .common import D_NOPE, _cta_barrier, partition_row, request_blocks, stage_q, store_out_staged, tile_ptrs

__all__ = ["consumer_pv", "consumer_qk"]


@gluon.jit
def _store_out_half(
    o, q_smem, out, req, sq, hb, h_q, heads_o, cols_o, hmask_o, HALF: gl.constexpr, STAGED: gl.constexpr
):
    """An unsplit request's O half ``HALF`` (bf16, the wgmma's accumulator layout; rows ``heads_o``,
    columns ``cols_o`` of ``out``, rows ``hmask_o`` stored): stored as it is laid out, or (``STAGED``: the sparse prefill,
    one request a CTA, whose Q tile is dead by then) through Q's half in shared memory
    (:func:`.common.store_out_staged`)."""
    if STAGED:
        buf = q_smem.slice(HALF * (D_NOPE // 2), D_NOPE // 2, dim=1)
        store_out_staged(o, buf, out, req, sq, hb * 64, h_q, HALF * (D_NOPE // 2))
    else:
        optr = tile_ptrs(out, req.to(gl.int64), sq, gl.expand_dims(heads_o, 1), gl.expand_dims(cols_o, 0))
        gl.store(optr, o, mask=hmask_o)


@gluon.jit
def _scores(q_smem, qr_smem, ring, stage, scale_log2, S_L: gl.constexpr, KV_BF16: gl.constexpr, IS_V32: gl.constexpr):
    """``S = Q Kᵀ`` of ring stage ``stage`` (``[64 heads, tokens]``, layout ``S_L``) with its invalid
    tokens at -inf, and its row max in log2 units. A select, not an add: an invalid token's score
    is q·0, NaN when q holds an inf. The bf16-row prefill (``KV_BF16``) keeps raw scores, the scale
    (> 0, validated) applied to the row max and inside the exponent's FMA (one instruction per score
    fewer; measured on the H200: 1.6-2.4 % faster there, 0-1.6 % slower on the FP8 decode's rows)."""
    k_smem, kr_smem, mask_smem = ring[0], ring[1], ring[2]
    SUB: gl.constexpr = k_smem.shape[1]
    s = warpgroup_mma(q_smem, k_smem.index(stage).permute([1, 0]), gl.zeros([64, SUB], gl.float32, S_L), use_acc=False)
    if IS_V32:
        s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute([1, 0]), s)
    bias = mask_smem.index(stage).load(gl.SliceLayout(0, S_L))
    if KV_BF16:
        s = gl.where(gl.expand_dims(bias, 0) == 0.0, s, float("-inf"))
        mx = gl.max(s, axis=1) * scale_log2
    else:
        s = gl.where(gl.expand_dims(bias, 0) == 0.0, s * scale_log2, float("-inf"))
        mx = gl.max(s, axis=1)
    return s, mx


@gluon.jit
def _probs(s, m_safe, scale_log2, KV_BF16: gl.constexpr):
    """``exp2`` of the scores (log2 units) less the row maxima ``m_safe``."""
    if KV_BF16:
        p = gl.exp2(gl.fma(s, scale_log2, -gl.expand_dims(m_safe, 1)))
    else:
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    return p


@gluon.jit
def _qk_step(
    it,
    hs,
    acc,
    m_i,
    l_i,
    q_smem,
    qr_smem,
    p_smem,
    ring,
    hand,
    scale_log2,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
    KV_BF16: gl.constexpr,
    IS_V32: gl.constexpr,
):
    """One step of warpgroup 0 (:func:`consumer_qk`): ring stage ``it``, P hand-off ``hs``.
    Returns ``(acc, m_i, l_i)``."""
    k_smem, _kr, _mask, ready_bars, empty_bars = ring
    row_smem, p_full, p_empty = hand
    NS: gl.constexpr = k_smem.shape[0]
    stage = it % NS
    mbarrier.wait(ready_bars.index(stage), (it // NS) & 1)
    if KV_BF16:  # cp.async wrote the stage (generic proxy); wgmma reads it (async proxy)
        fence_async_shared()
    kbuf = k_smem.index(stage)
    s, mx = _scores(q_smem, qr_smem, ring, stage, scale_log2, S_L, KV_BF16, IS_V32)
    m_new = gl.maximum(m_i, mx)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = _probs(s, m_safe, scale_log2, KV_BF16)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    m_i = m_new
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
    # warpgroup 1 has finished the previous P (its PV) and row factors
    mbarrier.wait(p_empty, (hs & 1) ^ 1)
    p_smem.store(p.to(gl.bfloat16))
    row_smem.store(alpha)
    fence_async_shared()
    _cta_barrier()
    mbarrier.arrive(p_full, count=1)
    acc = warpgroup_mma(p_smem, kbuf.slice(0, D_NOPE // 2, dim=1), acc)
    _cta_barrier()
    mbarrier.arrive(empty_bars.index(stage), count=1)
    return acc, m_i, l_i


@gluon.jit
def consumer_qk(
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
    hand,
    KV_BF16: gl.constexpr,
    IS_V32: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr,
):
    """64-head tiles, consumers split by role, warpgroup 0 (the default partition): the whole
    ``S = Q Kᵀ [64, 64]`` (one warpgroup, N = 64: Q is read from smem once per block), the online
    softmax inside the warpgroup (no cross-warpgroup max/sum), P and the row factors handed to
    warpgroup 1 (:func:`consumer_pv`) through smem, and ``O[:, :256] += P V``.
    At the end of a request piece the row factor of the epilogue goes the same way, and this
    warpgroup writes ``out[:, :256]``, lse and max_logits (or the split partials' left half and LSE)."""
    q_ptr, stride_qb, stride_qs, stride_qh = q
    _meta_ptr, nsplit_ptr, _mainblk_ptr, _nblk_ptr = sched
    lse_ptr, stride_lb, stride_lh, stride_ls = lse
    lacc_ptr, stride_lr, stride_lsq = lse_acc
    ml_ptr, stride_mlb, stride_mlh = max_logits
    k_smem = ring[0]
    row_smem, p_full, p_empty = hand
    SUB: gl.constexpr = k_smem.shape[1]  # tokens a stage (64, or 32: two steps a block)
    STEPS: gl.constexpr = 64 // SUB
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUB, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    SROW: gl.constexpr = gl.SliceLayout(1, S_L)
    OROW: gl.constexpr = gl.SliceLayout(1, O_L)
    OCOL: gl.constexpr = gl.SliceLayout(0, O_L)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    sq = gl.program_id(1)
    hb = gl.program_id(2)
    prow = partition_row(sched[0])
    begin_req, end_req, begin_split = prow[0], prow[1], prow[4]

    heads_s = hb * 64 + gl.arange(0, 64, layout=SROW)
    heads_o = hb * 64 + gl.arange(0, 64, layout=OROW)
    hmask_s = heads_s < h_q
    hmask_o = gl.expand_dims(heads_o < h_q, 1)
    cols_o = gl.arange(0, D_NOPE // 2, layout=OCOL)
    qr = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
    qc = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    qmask = gl.expand_dims(qr < h_q, 1)
    if HAS_SINK:
        sink_log2 = gl.load(sink_ptr + heads_s, mask=hmask_s, other=0.0) * 1.4426950408889634

    it = 0  # K stage hand-offs
    hs = 0  # P / row-factor hand-offs to warpgroup 1
    req = begin_req
    while req <= end_req:
        blk0, blk1 = request_blocks(sched, prow, req, HAS_EXTRA)
        split = gl.where(req == begin_req, begin_split, 0)
        split_base = gl.load(nsplit_ptr + req)
        n_splits = gl.load(nsplit_ptr + req + 1) - split_base

        qbase = q_ptr + req.to(gl.int64) * stride_qb + sq * stride_qs
        stage_q(q_smem, qr_smem, qbase + gl.expand_dims(qr.to(gl.int64) * stride_qh, 1) + gl.expand_dims(qc, 0),
                qmask, IS_V32)  # fmt: skip

        m_i = gl.full([64], float("-inf"), gl.float32, SROW)
        l_i = gl.zeros([64], gl.float32, SROW)
        acc = gl.zeros([64, D_NOPE // 2], gl.float32, O_L)
        for _step in range(blk0 * STEPS, blk1 * STEPS):
            acc, m_i, l_i = _qk_step(
                it, hs, acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, hand, scale_log2, S_L, O_L, KV_BF16, IS_V32
            )
            it += 1
            hs += 1

        # epilogue (same formulas as the tl kernel); the row factor goes to warpgroup 1 first
        lonely = l_i == 0.0
        l_safe = gl.where(lonely, 1.0, l_i)
        m_safe2 = gl.where(lonely, 0.0, m_i)
        lse2 = gl.where(lonely, float("-inf"), gl.log2(l_safe) + m_safe2)
        if n_splits <= 1:
            denom = l_safe
            if HAS_SINK:
                denom += gl.exp2(sink_log2 - m_safe2)
            scale_row = gl.where(lonely, 0.0, 1.0 / denom)
        else:
            scale_row = 1.0 / l_safe
        mbarrier.wait(p_empty, (hs & 1) ^ 1)
        row_smem.store(scale_row)
        _cta_barrier()
        mbarrier.arrive(p_full, count=1)
        hs += 1
        o = acc * gl.expand_dims(gl.convert_layout(scale_row, OROW), 1)
        if n_splits <= 1:
            _store_out_half(
                o.to(gl.bfloat16), q_smem, out, req, sq, hb, h_q, heads_o, cols_o, hmask_o, 0, HAS_MAX_LOGITS
            )
            lse_v = gl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
            gl.store(lse_ptr + req.to(gl.int64) * stride_lb + heads_s * stride_lh + sq * stride_ls, lse_v, mask=hmask_s)
            if HAS_MAX_LOGITS:  # (sparse prefill: s_q 1, never split) max of q·k·sm_scale, -inf for no
                # key; NaN scores are skipped by the max and show in l_i (prefill.reference.max_logits_rule)
                gl.store(
                    ml_ptr + req.to(gl.int64) * stride_mlb + heads_s * stride_mlh,
                    gl.where((l_i != l_i) & (m_i != float("inf")), float("nan"), m_i * 0.6931471805599453),
                    mask=hmask_s,
                )
        else:
            row = (split_base + split).to(gl.int64)
            aptr = tile_ptrs(o_acc, row, sq, gl.expand_dims(heads_o, 1), gl.expand_dims(cols_o, 0))
            gl.store(aptr, o, mask=hmask_o)
            gl.store(lacc_ptr + row * stride_lr + sq * stride_lsq + heads_s, lse2, mask=hmask_s)
        req += 1


@gluon.jit
def consumer_pv(
    sched,
    out,
    o_acc,
    h_q,
    q_smem,
    p_smem,
    ring,
    hand,
    KV_BF16: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr,
):
    """Warpgroup 1 of the split consumers (a worker partition): ``O[:, 256:] += P V`` with the P and
    row factors warpgroup 0 (:func:`consumer_qk`) leaves in smem, and ``out[:, 256:]`` (or the
    split partials' right half) at the end of each request piece."""
    _meta_ptr, nsplit_ptr, _mainblk_ptr, _nblk_ptr = sched
    k_smem = ring[0]
    empty_bars = ring[4]
    NS: gl.constexpr = k_smem.shape[0]
    SUB: gl.constexpr = k_smem.shape[1]
    STEPS: gl.constexpr = 64 // SUB
    row_smem, p_full, p_empty = hand
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    OROW: gl.constexpr = gl.SliceLayout(1, O_L)
    OCOL: gl.constexpr = gl.SliceLayout(0, O_L)

    sq = gl.program_id(1)
    hb = gl.program_id(2)
    prow = partition_row(sched[0])
    begin_req, end_req, begin_split = prow[0], prow[1], prow[4]
    heads_o = hb * 64 + gl.arange(0, 64, layout=OROW)
    hmask_o = gl.expand_dims(heads_o < h_q, 1)
    cols_o = D_NOPE // 2 + gl.arange(0, D_NOPE // 2, layout=OCOL)

    it = 0
    hs = 0
    req = begin_req
    while req <= end_req:
        blk0, blk1 = request_blocks(sched, prow, req, HAS_EXTRA)
        split = gl.where(req == begin_req, begin_split, 0)
        split_base = gl.load(nsplit_ptr + req)
        n_splits = gl.load(nsplit_ptr + req + 1) - split_base
        acc = gl.zeros([64, D_NOPE // 2], gl.float32, O_L)
        for _step in range(blk0 * STEPS, blk1 * STEPS):
            stage = it % NS
            mbarrier.wait(p_full, hs & 1)
            if KV_BF16:
                fence_async_shared()
            alpha = row_smem.load(OROW)
            acc = acc * gl.expand_dims(alpha, 1)
            acc = warpgroup_mma(p_smem, k_smem.index(stage).slice(D_NOPE // 2, D_NOPE // 2, dim=1), acc)
            _cta_barrier()
            mbarrier.arrive(p_empty, count=1)
            mbarrier.arrive(empty_bars.index(stage), count=1)
            it += 1
            hs += 1
        mbarrier.wait(p_full, hs & 1)
        scale_row = row_smem.load(OROW)
        _cta_barrier()
        mbarrier.arrive(p_empty, count=1)
        hs += 1
        o = acc * gl.expand_dims(scale_row, 1)
        if n_splits <= 1:
            # (the sparse prefill: warpgroup 0 is done with Q once it hands the row factor over)
            _store_out_half(
                o.to(gl.bfloat16), q_smem, out, req, sq, hb, h_q, heads_o, cols_o, hmask_o, 1, HAS_MAX_LOGITS
            )
        else:
            row = (split_base + split).to(gl.int64)
            aptr = tile_ptrs(o_acc, row, sq, gl.expand_dims(heads_o, 1), gl.expand_dims(cols_o, 0))
            gl.store(aptr, o, mask=hmask_o)
        req += 1
