"""Warp-specialised split-KV sparse decode for Hopper, written in Gluon (prototype, V32 layout only).

Same launcher contract as :func:`sparse_mla.ops.sparse_decode.sparse_decode_fwd` (same scheduler
partition walk, same outputs: final bf16 ``out`` + natural-log ``lse`` for unsplit batches, fp32
partial O normalised by its own sum + log2-space LSE rows ``num_splits[req] + split`` for split
batches, merged by :mod:`sparse_mla.ops.combine`).

Structure of one CTA (one scheduler partition x one query token x 64 heads), FlashMLA-like:

* **producer partition** (worker, ``PRODUCER_WARPS`` = 4 warps, ``PRODUCER_REGS`` registers): for every
  64-index block of the partition's walk it takes the block's 64 indices (loaded one block ahead),
  issues every gather of the block at once with 16-byte loads (the 512 NoPE bytes as one
  ``[64, 4, 128]`` tile, the 4 power-of-two float32 scales as one load per token, the 64 bf16
  RoPE values), only then waits for a free stage of the 2-stage smem ring, dequantises to bf16
  (fp8 -> bf16 is exact, and so is the product with a power-of-two scale) and stores the
  ``[64, 576]`` bf16 K tile into the stage with one store per part (128-B swizzled NVMMA layout,
  wgmma-ready), plus an additive fp32 mask row (0 for a valid token, -inf otherwise). Invalid
  tokens are never loaded (K row = 0). Then ``fence_async_shared`` and an mbarrier arrive on
  ``ready[stage]``.
* **consumer = default partition** (8 warps = 2 warpgroups): per request piece it stages
  ``Q [64, 576]`` bf16 in smem once; per block it waits ``ready[stage]``, computes
  ``S = Q Kᵀ [64, 64]`` with one wgmma whose accumulator layout is ``warps_per_cta = [4, 2]``: the
  two warpgroups each compute 32 of the 64 key columns (QKᵀ is done once, not twice); exp2
  online softmax (row max / row sum cross the two warpgroups through a small smem scratch that
  the compiler inserts); P (bf16) goes to smem; ``O += P V`` with ``V = K[:, :512]``, accumulator
  ``[64, 512]`` fp32 in the ``[4, 2]`` wgmma layout: warpgroup 0 owns columns 0-255, warpgroup 1
  columns 256-511 (128 fp32 registers per thread each). After the PV wgmma the stage is released
  (``empty[stage]`` arrive).

Shared memory (power-of-two shapes only, so Q and K are NoPE [.., 512] + RoPE [.., 64] allocations):
Q 72 KiB + K ring 2 x 72 KiB + P 8 KiB + masks 512 B + barriers = 230,500 B as compiled (the
H100/H200 opt-in limit is 232,448 B). Registers: ``maxnreg`` 168 for 12 warps (1 CTA/SM); the
producer runs at ``PRODUCER_REGS`` (128: one block's gathers in flight), the consumer at what is
left (184, ``setmaxnreg``). ptxas (sm_90a): ~200 B of spills, nearly all outside the block loops
(loop-invariant addresses; 1 store / 2 loads in the consumer's loop); see
``scripts/gluon_compile_check.py``. Where the time goes (producer alone, consumer alone, ncu stall
samples) is in ``docs/perf.md``; ``SPARSE_MLA_GLUON_PROFILE`` switches the profiling modes.

h_q that is not a multiple of 64 (e.g. 16 or 32 heads of a tensor-parallel slice) runs in 64-head
tiles whose rows past h_q are zero queries that are never stored. Not supported in this prototype
(``NotImplementedError``): MODEL1 layout, extra cache.
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from ..interface import DecodeProblem
from ..scheduler import TOPK_BLOCK_SIZE, ScheduleTable

LOG2E = 1.4426950408889634

BLOCK_H = 64  # heads per CTA (wgmma M)
BLOCK_N = 64  # tokens per block (= scheduler block)
D_NOPE = gl.constexpr(512)
D_ROPE = gl.constexpr(64)
D_QK = gl.constexpr(576)
NUM_STAGES = gl.constexpr(2)
CONSUMER_WARPS = 8
PRODUCER_WARPS = 4  # 8 (two producer warpgroups) does not fit: ptxas wants >= 154 registers per thread at 16 warps
PRODUCER_REGS = int(os.environ.get("SPARSE_MLA_GLUON_PRODUCER_REGS", "128"))
MAXNREG = int(os.environ.get("SPARSE_MLA_GLUON_MAXNREG", "168"))
# experiment knobs (benchmarks/gluon_variants.py): PROFILE 0 = normal; 1 = consumer skips its work
# (producer alone); 2 = producer skips gathers/convert (consumer alone); 3 = producer gathers one
# cache-resident token for every row (convert without HBM latency). Outputs are garbage for 1-3.
PROFILE = int(os.environ.get("SPARSE_MLA_GLUON_PROFILE", "0"))
# producer register layouts: 8 token rows x 4 threads per warp, 16 bytes per thread. With 4 rows x 8
# threads the stores into the 128-B swizzled K tile took 1.7x the ideal smem wavefronts (ncu)
TPW_ROWS = gl.constexpr(8)


# --------------------------------------------------------------------------------------------- producer
@gluon.jit
def _load_block_indices(ibase, stride_it, pos0, n_valid, ROW8: gl.constexpr):
    offs8 = pos0 + gl.arange(0, 64, layout=ROW8)
    in8 = offs8 < n_valid
    return gl.load(ibase + offs8 * stride_it, mask=in8, other=-1)


@gluon.jit
def _producer(
    kv_ptr, stride_blk, stride_tok, num_tokens, pbs,
    idx_ptr, stride_ib, stride_is, stride_it, topk,
    tl_ptr, meta_ptr, mainblk_ptr, nblk_ptr,
    k_smem, kr_smem, mask_smem, ready_bars, empty_bars,
    HAS_TOPK_LEN: gl.constexpr, PBS_POW2: gl.constexpr, PBS_LOG2: gl.constexpr,
    PROFILE_: gl.constexpr,
):
    P_WARPS: gl.constexpr = gl.num_warps()
    # rows (tokens) of a [64, 128]-byte tile: the layout the 64 indices are loaded and decoded in
    LD8: gl.constexpr = gl.BlockedLayout([1, 16], [TPW_ROWS, 32 // TPW_ROWS], [P_WARPS, 1], [1, 0])
    # [64 tokens, 64 bf16] RoPE: 8 bf16 = 16 B per thread
    LDR: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_ROWS, 32 // TPW_ROWS], [P_WARPS, 1], [1, 0])
    ROW8: gl.constexpr = gl.SliceLayout(1, LD8)
    ROWR: gl.constexpr = gl.SliceLayout(1, LDR)
    COLR: gl.constexpr = gl.SliceLayout(0, LDR)

    part = gl.program_id(0)
    sq = gl.program_id(1)
    mrow = meta_ptr + part * 8
    begin_req = gl.load(mrow + 0)
    end_req = gl.load(mrow + 1)
    begin_block = gl.load(mrow + 2)
    end_block = gl.load(mrow + 3)

    colsr = gl.arange(0, D_ROPE, layout=COLR)
    # NoPE bytes as [64 tokens, 4 column tiles, 128 bytes]: 16 contiguous bytes per thread
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [TPW_ROWS, 1, 32 // TPW_ROWS], [P_WARPS, 1, 1], [2, 1, 0])
    L3S: gl.constexpr = gl.SliceLayout(2, L3)
    ROW3: gl.constexpr = gl.SliceLayout(1, L3S)
    t3 = gl.arange(0, 4, layout=gl.SliceLayout(0, L3S))
    c3 = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    it = 0
    req = begin_req
    while req <= end_req:
        blk0 = gl.where(req == begin_req, begin_block, 0)
        blk1 = gl.where(req == end_req, end_block, gl.load(nblk_ptr + req))
        blk1 = gl.minimum(blk1, gl.load(mainblk_ptr + req))
        n_valid = topk
        if HAS_TOPK_LEN:
            n_valid = gl.minimum(gl.load(tl_ptr + req), topk)
        ibase = idx_ptr + req.to(gl.int64) * stride_ib + sq * stride_is
        # the first block's indices; every iteration then loads the next block's (prefetch)
        idx_next = _load_block_indices(ibase, stride_it, blk0 * 64, n_valid, ROW8)
        for blk in range(blk0, blk1):
            stage = it % 2
            phase = (it // 2) & 1
            pos0 = blk * 64
            if PROFILE_ == 2:
                mbarrier.wait(empty_bars.index(stage), phase ^ 1)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ready_bars.index(stage), count=1)
            else:
                offs8 = pos0 + gl.arange(0, 64, layout=ROW8)
                in8 = offs8 < n_valid
                idx8 = idx_next
                idx_next = _load_block_indices(ibase, stride_it, pos0 + 64, gl.minimum(n_valid, blk1 * 64), ROW8)
                v8 = in8 & (idx8 >= 0) & (idx8 < num_tokens)
                s8 = gl.where(v8, idx8, 0)
                if PROFILE_ == 3:
                    s8 = s8 * 0
                if PBS_POW2:
                    b8 = s8 >> PBS_LOG2
                    o8 = s8 & (pbs - 1)
                else:
                    b8 = s8 // pbs
                    o8 = s8 - b8 * pbs
                tok8 = b8.to(gl.int64) * stride_blk + o8.to(gl.int64) * stride_tok
                tok8 = gl.multiple_of(tok8, 16)
                tokr = gl.convert_layout(tok8, ROWR)
                vr = gl.convert_layout(v8, ROWR)
                rptr = (kv_ptr + gl.expand_dims(tokr, 1) + D_NOPE + 16).to(gl.pointer_type(gl.bfloat16))
                vmask = gl.where(v8, 0.0, float("-inf"))
                tok3 = gl.convert_layout(tok8, ROW3)
                v3 = gl.convert_layout(v8, ROW3)
                # every gather of the block is in flight before the wait for a free stage: the 512
                # NoPE bytes as one [64, 4, 128] tile (16-byte loads), the 4 scales as one 16-byte
                # load per token, the 64 bf16 RoPE values (PRODUCER_REGS = 128 holds them)
                p3 = (kv_ptr + gl.expand_dims(gl.expand_dims(tok3, 1), 2)
                      + gl.expand_dims(gl.expand_dims(t3, 0), 2) * 128 + gl.expand_dims(gl.expand_dims(c3, 0), 1))
                raw = gl.load(p3, mask=gl.expand_dims(gl.expand_dims(v3, 1), 2), other=0)
                sp = (kv_ptr + gl.expand_dims(tok3, 1) + D_NOPE).to(gl.pointer_type(gl.float32))
                sc = gl.load(sp + gl.expand_dims(t3, 0), mask=gl.expand_dims(v3, 1), other=0.0)
                rope = gl.load(rptr + gl.expand_dims(colsr, 0), mask=gl.expand_dims(vr, 1), other=0.0)
                # wait for the consumer to free this stage (first lap passes: phase starts at 1)
                mbarrier.wait(empty_bars.index(stage), phase ^ 1)
                # fp8 -> bf16 is exact, and so is the product with a power-of-two scale; one smem
                # store for the whole NoPE tile (separate column-slice stores each cost a barrier)
                kv = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(sc, 2)).to(gl.bfloat16)
                k_smem.index(stage).store(gl.reshape(kv, [64, D_NOPE]))
                kr_smem.index(stage).store(rope)
                mask_smem.index(stage).store(vmask)
                # make the generic-proxy stores visible to wgmma (async proxy), then signal
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ready_bars.index(stage), count=1)
            it += 1
        req += 1


# --------------------------------------------------------------------------------------------- consumer
@gluon.jit
def _consumer(
    q_ptr, stride_qb, stride_qs, stride_qh,
    sink_ptr, meta_ptr, nsplit_ptr, mainblk_ptr, nblk_ptr,
    out_ptr, stride_ob, stride_os, stride_oh,
    lse_ptr, stride_lb, stride_lh, stride_ls,
    oacc_ptr, stride_ar, stride_as, stride_ah,
    lacc_ptr, stride_lr, stride_lsq,
    scale_log2, h_q,
    q_smem, qr_smem, k_smem, kr_smem, p_smem, mask_smem, ready_bars, empty_bars,
    HAS_SINK: gl.constexpr, PROFILE_: gl.constexpr,
):
    NW: gl.constexpr = gl.num_warps()
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NW // 4], instr_shape=[16, 32, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NW // 4], instr_shape=[16, 256, 16])
    SROW: gl.constexpr = gl.SliceLayout(1, S_L)
    SCOL: gl.constexpr = gl.SliceLayout(0, S_L)
    OROW: gl.constexpr = gl.SliceLayout(1, O_L)
    OCOL: gl.constexpr = gl.SliceLayout(0, O_L)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])

    part = gl.program_id(0)
    sq = gl.program_id(1)
    hb = gl.program_id(2)
    mrow = meta_ptr + part * 8
    begin_req = gl.load(mrow + 0)
    end_req = gl.load(mrow + 1)
    begin_block = gl.load(mrow + 2)
    end_block = gl.load(mrow + 3)
    begin_split = gl.load(mrow + 4)

    # h_q not a multiple of 64: the last tile's rows past h_q are zero queries, never stored
    heads_s = hb * 64 + gl.arange(0, 64, layout=SROW)
    heads_o = hb * 64 + gl.arange(0, 64, layout=OROW)
    hmask_s = heads_s < h_q
    hmask_o = gl.expand_dims(heads_o < h_q, 1)
    cols_o = gl.arange(0, D_NOPE, layout=OCOL)
    qr = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
    qc = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    qmask = gl.expand_dims(qr < h_q, 1)
    if HAS_SINK:
        sink_log2 = gl.load(sink_ptr + heads_s, mask=hmask_s, other=0.0) * 1.4426950408889634

    it = 0
    req = begin_req
    while req <= end_req:
        blk0 = gl.where(req == begin_req, begin_block, 0)
        blk1 = gl.where(req == end_req, end_block, gl.load(nblk_ptr + req))
        blk1 = gl.minimum(blk1, gl.load(mainblk_ptr + req))
        split = gl.where(req == begin_req, begin_split, 0)
        split_base = gl.load(nsplit_ptr + req)
        n_splits = gl.load(nsplit_ptr + req + 1) - split_base

        # stage Q [64, 576] once for this request piece (9 column chunks of 64)
        qbase = q_ptr + req.to(gl.int64) * stride_qb + sq * stride_qs
        qrow = qbase + gl.expand_dims(qr.to(gl.int64) * stride_qh, 1) + gl.expand_dims(qc, 0)
        for c in gl.static_range(D_NOPE // 64):
            q_smem.slice(c * 64, 64, dim=1).store(gl.load(qrow + c * 64, mask=qmask, other=0.0))
        qr_smem.store(gl.load(qrow + D_NOPE, mask=qmask, other=0.0))
        fence_async_shared()
        gl.thread_barrier()

        m_i = gl.full([64], float("-inf"), gl.float32, SROW)
        l_i = gl.zeros([64], gl.float32, SROW)
        acc = gl.zeros([64, D_NOPE], gl.float32, O_L)
        for blk in range(blk0, blk1):
            stage = it % 2
            phase = (it // 2) & 1
            mbarrier.wait(ready_bars.index(stage), phase)
            if PROFILE_ == 1:
                gl.thread_barrier()
                mbarrier.arrive(empty_bars.index(stage), count=1)
            else:
                kbuf = k_smem.index(stage)
                s = warpgroup_mma(q_smem, kbuf.permute([1, 0]), gl.zeros([64, 64], gl.float32, S_L), use_acc=False)
                s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute([1, 0]), s)
                bias = mask_smem.index(stage).load(SCOL)
                # a select, not an add: an invalid token's score is q·0, NaN when q holds an inf
                s = gl.where(gl.expand_dims(bias, 0) == 0.0, s * scale_log2, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - gl.expand_dims(m_safe, 1))
                l_i = l_i * alpha + gl.sum(p, axis=1)
                m_i = m_new
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, OROW), 1)
                # the previous block's PV (the last reader of P) completed before that block's final
                # barrier, so P can be overwritten without another barrier here
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                gl.thread_barrier()
                acc = warpgroup_mma(p_smem, kbuf, acc)
                # both warpgroups finished their PV wgmma on this stage -> release it to the producer
                gl.thread_barrier()
                mbarrier.arrive(empty_bars.index(stage), count=1)
            it += 1

        # epilogue (same formulas as the tl kernel)
        lonely = l_i == 0.0
        l_safe = gl.where(lonely, 1.0, l_i)
        m_safe2 = gl.where(lonely, 0.0, m_i)
        lse2 = gl.where(lonely, float("-inf"), gl.log2(l_safe) + m_safe2)
        if n_splits == 1:
            denom = l_safe
            if HAS_SINK:
                denom += gl.exp2(sink_log2 - m_safe2)
            scale_row = gl.where(lonely, 0.0, 1.0 / denom)
            o = acc * gl.expand_dims(gl.convert_layout(scale_row, OROW), 1)
            optr = (out_ptr + req.to(gl.int64) * stride_ob + sq * stride_os
                    + gl.expand_dims(heads_o * stride_oh, 1) + gl.expand_dims(cols_o, 0))
            gl.store(optr, o.to(gl.bfloat16), mask=hmask_o)
            lse = gl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
            gl.store(lse_ptr + req.to(gl.int64) * stride_lb + heads_s * stride_lh + sq * stride_ls, lse, mask=hmask_s)
        else:
            row = (split_base + split).to(gl.int64)
            o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, OROW), 1)
            aptr = (oacc_ptr + row * stride_ar + sq * stride_as
                    + gl.expand_dims(heads_o * stride_ah, 1) + gl.expand_dims(cols_o, 0))
            gl.store(aptr, o, mask=hmask_o)
            gl.store(lacc_ptr + row * stride_lr + sq * stride_lsq + heads_s, lse2, mask=hmask_s)
        req += 1


# --------------------------------------------------------------------------------------------- kernel
@gluon.jit
def _sparse_decode_gluon_kernel(
    q_ptr, stride_qb, stride_qs, stride_qh,
    kv_ptr, stride_blk, stride_tok, num_tokens, pbs,
    idx_ptr, stride_ib, stride_is, stride_it, topk,
    tl_ptr, sink_ptr,
    meta_ptr, nsplit_ptr, mainblk_ptr, nblk_ptr,
    out_ptr, stride_ob, stride_os, stride_oh,
    lse_ptr, stride_lb, stride_lh, stride_ls,
    oacc_ptr, stride_ar, stride_as, stride_ah,
    lacc_ptr, stride_lr, stride_lsq,
    scale_log2, h_q,
    HAS_TOPK_LEN: gl.constexpr, HAS_SINK: gl.constexpr, PBS_POW2: gl.constexpr, PBS_LOG2: gl.constexpr,
    PRODUCER_WARPS_: gl.constexpr, PRODUCER_REGS_: gl.constexpr,
    PROFILE_: gl.constexpr,
):
    SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # power-of-two shapes only: Q and K are kept as NoPE [.., 512] + RoPE [.., 64] tiles
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, D_NOPE], SW)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [64, D_ROPE], SW)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 64, D_NOPE], SW)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 64, D_ROPE], SW)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], SW)
    mask_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 64],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)

    gl.warp_specialize([
        (_consumer, (
            q_ptr, stride_qb, stride_qs, stride_qh,
            sink_ptr, meta_ptr, nsplit_ptr, mainblk_ptr, nblk_ptr,
            out_ptr, stride_ob, stride_os, stride_oh,
            lse_ptr, stride_lb, stride_lh, stride_ls,
            oacc_ptr, stride_ar, stride_as, stride_ah,
            lacc_ptr, stride_lr, stride_lsq,
            scale_log2, h_q,
            q_smem, qr_smem, k_smem, kr_smem, p_smem, mask_smem, ready_bars, empty_bars,
            HAS_SINK, PROFILE_,
        )),
        (_producer, (
            kv_ptr, stride_blk, stride_tok, num_tokens, pbs,
            idx_ptr, stride_ib, stride_is, stride_it, topk,
            tl_ptr, meta_ptr, mainblk_ptr, nblk_ptr,
            k_smem, kr_smem, mask_smem, ready_bars, empty_bars,
            HAS_TOPK_LEN, PBS_POW2, PBS_LOG2, PROFILE_,
        )),
    ], [PRODUCER_WARPS_], [PRODUCER_REGS_])


# --------------------------------------------------------------------------------------------- launcher
def supported(p: DecodeProblem) -> bool:
    """Whether this kernel handles ``p`` (V32 layout, no extra cache; any h_q, in 64-head tiles)."""
    return p.layout.name == "V32" and p.extra_k_cache is None


def sparse_decode_fwd(p: DecodeProblem, table: ScheduleTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the warp-specialised Gluon kernel (and the combine kernel when a batch is split).

    Same contract as :func:`sparse_mla.ops.sparse_decode.sparse_decode_fwd`.

    Raises:
        NotImplementedError: MODEL1 layout or extra cache.
    """
    from .combine import combine_fwd, split_accumulators

    if p.layout.name != "V32":
        raise NotImplementedError("gluon sparse decode: only the V32 (d_qk = 576) layout is implemented")
    if p.extra_k_cache is not None:
        raise NotImplementedError("gluon sparse decode: extra_k_cache is not implemented in this prototype")
    q = p.q
    b, s_q, h_q, _ = q.shape
    assert TOPK_BLOCK_SIZE == BLOCK_N
    dev = q.device
    out = torch.empty(b, s_q, h_q, p.d_v, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=dev)
    o_acc, l_acc = split_accumulators(b, s_q, h_q, p.d_v, table.num_sm_parts, table.any_split, dev)
    kc = p.k_cache
    raw = kc if kc.dtype == torch.uint8 else kc.view(torch.uint8)
    pbs = raw.shape[1]
    pow2 = pbs & (pbs - 1) == 0
    num_tokens = raw.shape[0] * pbs
    dummy_i32 = table.num_splits
    grid = (table.num_sm_parts, s_q, -(-h_q // BLOCK_H))
    _sparse_decode_gluon_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2),
        raw, raw.stride(0), raw.stride(1), num_tokens, pbs,
        p.indices, *p.indices.stride(), p.indices.shape[2],
        p.topk_length if p.topk_length is not None else dummy_i32,
        p.attn_sink if p.attn_sink is not None else l_acc,
        table.metadata, table.num_splits, table.main_blocks, table.num_blocks_t,
        out, out.stride(0), out.stride(1), out.stride(2),
        lse, lse.stride(0), lse.stride(1), lse.stride(2),
        o_acc, o_acc.stride(0), o_acc.stride(1), o_acc.stride(2),
        l_acc, l_acc.stride(0), l_acc.stride(1),
        p.sm_scale * LOG2E, h_q,
        HAS_TOPK_LEN=p.topk_length is not None, HAS_SINK=p.attn_sink is not None,
        PBS_POW2=pow2, PBS_LOG2=pbs.bit_length() - 1 if pow2 else 0,
        PRODUCER_WARPS_=PRODUCER_WARPS, PRODUCER_REGS_=PRODUCER_REGS,
        PROFILE_=PROFILE,
        num_warps=CONSUMER_WARPS, maxnreg=MAXNREG,
    )
    if table.any_split:
        combine_fwd(o_acc, l_acc, table.num_splits, out, lse, p.attn_sink)
    return out, lse
