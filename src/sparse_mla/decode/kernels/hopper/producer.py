"""The producer partition of the Hopper kernel: for every 64-token block of its partition's walk,
gather the block's cache records (or copy its bf16 rows), dequantise them and stage the K tile in
the shared-memory ring for the consumers (see the package doc)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .common import D_NOPE, D_ROPE, TPW_ROWS, _async_load, _cta_barrier, partition_row, request_blocks

__all__ = ["producer"]


@gluon.jit
def _block_indices(
    blk,
    blk1,
    mb,
    ibase,
    stride_it,
    n_main,
    xibase,
    x_stride_it,
    n_extra,
    HAS_EXTRA: gl.constexpr,
    ROW8: gl.constexpr,
    H0: gl.constexpr = 0,
    N: gl.constexpr = 64,
):
    """The ``N`` indices from token ``H0`` of block ``blk`` of a request (main-cache blocks first,
    then the extra cache's from block ``mb`` on); -1 past the list's length, and for ``blk >= blk1``
    (none)."""
    offs = H0 + gl.arange(0, N, layout=ROW8)
    if HAS_EXTRA:
        is_x = blk >= mb
        pos = gl.where(is_x, blk - mb, blk) * 64 + offs
        ptrs = gl.where(is_x, xibase + pos * x_stride_it, ibase + pos * stride_it)
        n_valid = gl.where(is_x, n_extra, n_main)
    else:
        pos = blk * 64 + offs
        ptrs = ibase + pos * stride_it
        n_valid = n_main
    return gl.load(ptrs, mask=(pos < n_valid) & (blk < blk1), other=-1)


@gluon.jit
def _gather_block(
    idx8,
    c_ptr,
    c_sblk,
    c_ntok,
    c_pbs,
    stride_tok,
    IS_V32: gl.constexpr,
    PBS_SHIFT: gl.constexpr,
    PBS_LOG2: gl.constexpr,
    ALIGN: gl.constexpr,
    P_WARPS: gl.constexpr,
):
    """Issue every gather of one 64-token block (indices ``idx8``) of one cache: the NoPE bytes as
    one ``[64, NT, TW]`` tile (16-byte loads), the scales as one load per token, the 64 bf16 RoPE
    values. Returns ``(raw, scales, rope, mask row)``; invalid tokens are never loaded."""
    LDR: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_ROWS, 32 // TPW_ROWS], [P_WARPS, 1], [1, 0])
    ROWR: gl.constexpr = gl.SliceLayout(1, LDR)
    COLR: gl.constexpr = gl.SliceLayout(0, LDR)
    NT: gl.constexpr = 4 if IS_V32 else 8
    TW: gl.constexpr = 128 if IS_V32 else 64
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [TPW_ROWS, 1, 32 // TPW_ROWS], [P_WARPS, 1, 1], [2, 1, 0])
    L3S: gl.constexpr = gl.SliceLayout(2, L3)
    ROW3: gl.constexpr = gl.SliceLayout(1, L3S)
    L3R: gl.constexpr = gl.SliceLayout(1, L3)
    ROW3R: gl.constexpr = gl.SliceLayout(1, L3R)
    t3 = gl.arange(0, NT, layout=gl.SliceLayout(0, L3S))
    c3 = gl.arange(0, TW, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    t3e = gl.expand_dims(gl.expand_dims(t3, 0), 2)

    v8 = (idx8 >= 0) & (idx8 < c_ntok)
    s8 = gl.where(v8, idx8, 0)
    if PBS_SHIFT:
        b8 = s8 >> PBS_LOG2
        o8 = s8 & (c_pbs - 1)
    else:
        b8 = s8 // c_pbs
        o8 = s8 - b8 * c_pbs
    blk8 = b8.to(gl.int64) * c_sblk
    if IS_V32:
        tok8 = blk8 + o8.to(gl.int64) * stride_tok
    else:  # MODEL1: packed [nope | rope] records of 576 B, then the blocks' 8-byte scale records
        tok8 = blk8 + o8.to(gl.int64) * 576
        scl8 = blk8 + c_pbs.to(gl.int64) * 576 + o8.to(gl.int64) * 8
    tok8 = gl.multiple_of(tok8, ALIGN)
    vmask = gl.where(v8, 0.0, float("-inf"))
    tok3 = gl.convert_layout(tok8, ROW3)
    v3 = gl.convert_layout(v8, ROW3)
    tok3e = gl.expand_dims(gl.expand_dims(tok3, 1), 2)
    v3e = gl.expand_dims(gl.expand_dims(v3, 1), 2)
    p3 = c_ptr + tok3e + t3e * TW + gl.expand_dims(gl.expand_dims(c3, 0), 1)
    if IS_V32:
        raw = gl.load(p3, mask=v3e, other=0)
        sp = (c_ptr + gl.expand_dims(tok3, 1) + D_NOPE).to(gl.pointer_type(gl.float32))
        sc = gl.load(sp + gl.expand_dims(t3, 0), mask=gl.expand_dims(v3, 1), other=0.0)
        tokr = gl.convert_layout(tok8, ROWR)
        vr = gl.convert_layout(v8, ROWR)
        colsr = gl.arange(0, D_ROPE, layout=COLR)
        rptr = (c_ptr + gl.expand_dims(tokr, 1) + D_NOPE + 16).to(gl.pointer_type(gl.bfloat16))
        rope = gl.load(rptr + gl.expand_dims(colsr, 0), mask=gl.expand_dims(vr, 1), other=0.0)
    else:
        raw = gl.load(p3, mask=v3e & (t3e < 7), other=0)
        scl3 = gl.convert_layout(scl8, ROW3)
        eb = gl.load(
            c_ptr + gl.expand_dims(scl3, 1) + gl.expand_dims(t3, 0),
            mask=gl.expand_dims(v3, 1) & gl.expand_dims(t3 < 7, 0),
            other=127,
        )
        # e8m0: 2^(e - 127), exact
        sc = gl.exp2(eb.to(gl.float32) - 127.0)
        tokq = gl.convert_layout(tok8, ROW3R)
        vq = gl.convert_layout(v8, ROW3R)
        cr3 = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, L3R))
        rptr = (c_ptr + gl.expand_dims(tokq, 1) + 448).to(gl.pointer_type(gl.bfloat16))
        rope = gl.load(rptr + gl.expand_dims(cr3, 0), mask=gl.expand_dims(vq, 1), other=0.0)
    return raw, sc, rope, vmask


@gluon.jit
def _stage_block(raw, sc, rope, vmask, ring, stage, phase, IS_V32: gl.constexpr, P_WARPS: gl.constexpr):
    """Wait for a free ``stage``, dequantise a gathered block into it, and signal ``ready``."""
    k_smem, kr_smem, mask_smem, ready_bars, empty_bars = ring
    NT: gl.constexpr = 4 if IS_V32 else 8
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [TPW_ROWS, 1, 32 // TPW_ROWS], [P_WARPS, 1, 1], [2, 1, 0])
    t3 = gl.arange(0, NT, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    t3e = gl.expand_dims(gl.expand_dims(t3, 0), 2)
    # wait for the consumer to free this stage (first lap passes: phase starts at 1)
    mbarrier.wait(empty_bars.index(stage), phase ^ 1)
    # fp8 -> bf16 is exact, and so is the product with a power-of-two scale; one smem
    # store for the whole tile (separate column-slice stores each cost a barrier). (The product
    # taken in bf16x2, 11 % fewer producer instructions, measured no faster: docs/experiments.md)
    kv = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(sc, 2)).to(gl.bfloat16)
    if IS_V32:
        k_smem.index(stage).store(gl.reshape(kv, [kv.shape[0], D_NOPE]))
        kr_smem.index(stage).store(rope)
    else:
        kv = gl.where(t3e == 7, gl.expand_dims(rope, 1), kv)
        k_smem.index(stage).store(gl.reshape(kv, [kv.shape[0], D_NOPE]))
    mask_smem.index(stage).store(vmask)
    # make the generic-proxy stores visible to wgmma (async proxy), then signal
    fence_async_shared()
    _cta_barrier()
    mbarrier.arrive(ready_bars.index(stage), count=1)


@gluon.jit
def _copy_block(idx8, rows, ring, stage, phase, IS_V32: gl.constexpr, ALIGN: gl.constexpr, P_WARPS: gl.constexpr):
    """``KV_BF16``: copy the 64 indexed rows of bf16 ``kv`` straight into ``stage`` with ``cp.async``
    (16-byte copies no register holds): the 512 NoPE values into ``k_smem`` (one copy op for the
    ``[64, 512]`` tile) and, V32, the 64 RoPE values into ``kr_smem``; MODEL1's 512 values are K and
    V. An invalid row (index < 0 or >= ``s_kv``; -1 past ``topk_length``) is never read: its copies
    zero-fill (K row = 0) and its mask entry is -inf. ``ready[stage]`` counts ``1 + 32 * P_WARPS``
    arrivals: each thread's ``cp.async.mbarrier.arrive.noinc`` (it fires when that thread's copies
    have landed) and the plain arrive after the mask store; the producer goes on to the next block
    without waiting for its copies, and the consumer fences them for its wgmma after its wait.

    ``ALIGN`` (bytes that divide every row address) below 4: a base pointer Triton only knows as
    2-byte aligned cannot take ``cp.async``; the rows are then loaded into registers in ``[64, 64]``
    column tiles and stored (correct, slow: views only)."""
    kv_ptr, stride_row, _stride_tok, num_rows, _pbs = rows
    k_smem, kr_smem, mask_smem, ready_bars, empty_bars = ring
    # 8 bf16 = 16 B per thread, 8 rows x 4 threads a warp (a row's 4 x 16 B land in distinct banks
    # of the 128-B swizzle)
    LDB: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_ROWS, 32 // TPW_ROWS], [P_WARPS, 1], [1, 0])
    ROWB: gl.constexpr = gl.SliceLayout(1, LDB)
    ALIGN_EL: gl.constexpr = ALIGN // 2
    v8 = (idx8 >= 0) & (idx8 < num_rows)
    s8 = gl.where(v8, idx8, 0)
    rowb = gl.convert_layout(gl.multiple_of(s8.to(gl.int64) * stride_row, ALIGN_EL), ROWB)
    vb = gl.expand_dims(gl.convert_layout(v8, ROWB), 1)
    vmask = gl.where(v8, 0.0, float("-inf"))
    src = kv_ptr + gl.expand_dims(rowb, 1)
    cols = gl.expand_dims(gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, LDB)), 0)
    colsr = gl.expand_dims(gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, LDB)), 0)
    # wait for the consumer to free this stage (first lap passes: phase starts at 1)
    mbarrier.wait(empty_bars.index(stage), phase ^ 1)
    if ALIGN >= 4:
        _async_load(k_smem.index(stage), src + cols, mask=vb)
        if IS_V32:
            _async_load(kr_smem.index(stage), src + D_NOPE + colsr, mask=vb)
        async_copy.mbarrier_arrive(ready_bars.index(stage), increment_count=False)
        mask_smem.index(stage).store(vmask)
    else:
        kbuf = k_smem.index(stage)
        for c in gl.static_range(D_NOPE // D_ROPE):
            kbuf.slice(c * D_ROPE, D_ROPE, dim=1).store(gl.load(src + c * D_ROPE + colsr, mask=vb, other=0.0))
        if IS_V32:
            kr_smem.index(stage).store(gl.load(src + D_NOPE + colsr, mask=vb, other=0.0))
        mask_smem.index(stage).store(vmask)
        fence_async_shared()
    _cta_barrier()
    mbarrier.arrive(ready_bars.index(stage), count=1)


@gluon.jit
def _block_cache(blk, mb, cache, xcache, HAS_EXTRA: gl.constexpr):
    """(pointer, block stride, tokens, page size) of the cache block ``blk`` of a request reads:
    the main one, or the extra one from block ``mb`` on."""
    kv_ptr, stride_blk, _stride_tok, num_tokens, pbs = cache
    xkv_ptr, x_stride_blk, x_num_tokens, x_pbs = xcache
    c_ptr = kv_ptr
    c_sblk = stride_blk
    c_ntok = num_tokens
    c_pbs = pbs
    if HAS_EXTRA:
        if blk >= mb:
            c_ptr = xkv_ptr
            c_sblk = x_stride_blk
            c_ntok = x_num_tokens
            c_pbs = x_pbs
    return c_ptr, c_sblk, c_ntok, c_pbs


@gluon.jit
def producer(
    cache,
    xcache,
    sel,
    xsel,
    sched,
    ring,
    KV_BF16: gl.constexpr,
    IS_V32: gl.constexpr,
    HAS_TOPK_LEN: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    HAS_EXTRA_LEN: gl.constexpr,
    PBS_POW2: gl.constexpr,
    PBS_LOG2: gl.constexpr,
    ALIGN: gl.constexpr,
    PART: gl.constexpr,
    NPART: gl.constexpr,
):
    """Gather, dequantise and stage the K tiles of this partition's blocks (see the package doc).

    With ``NPART`` producer partitions (2 beside the narrow consumer), partition ``PART`` takes
    the blocks whose running count ``it`` is ``PART`` mod ``NPART`` (ring stage ``it % 2``): each
    has its own barriers, so one partition's gathers are in flight while the other dequantises.
    With 32-token ring stages (``HopperConfig.half_stages``, 64-head tiles, one partition) a
    block's two halves are gathered together (both in flight) and staged one after the other into
    ring stages ``2 it`` and ``2 it + 1`` (mod the ring's depth)."""
    stride_tok = cache[2]
    idx_ptr, stride_ib, stride_is, stride_it, topk, topk_len_ptr = sel
    xidx_ptr, x_stride_ib, x_stride_is, x_stride_it, x_topk, x_len_ptr = xsel
    NS: gl.constexpr = ring[0].shape[0]  # ring stages
    SUB: gl.constexpr = ring[0].shape[1]  # tokens a stage: 64, or 32 (half blocks)
    _meta_ptr, _nsplit_ptr, mainblk_ptr, _nblk_ptr = sched
    P_WARPS: gl.constexpr = gl.num_warps()
    PBS_SHIFT: gl.constexpr = PBS_POW2 and not HAS_EXTRA
    # rows (tokens) of a [64, 128]-byte tile: the layout the 64 indices are loaded and decoded in
    LD8: gl.constexpr = gl.BlockedLayout([1, 16], [TPW_ROWS, 32 // TPW_ROWS], [P_WARPS, 1], [1, 0])
    ROW8: gl.constexpr = gl.SliceLayout(1, LD8)

    sq = gl.program_id(1)
    prow = partition_row(sched[0])
    begin_req, end_req = prow[0], prow[1]
    it = 0
    req = begin_req
    while req <= end_req:
        blk0, blk1 = request_blocks(sched, prow, req, HAS_EXTRA)
        mb = gl.load(mainblk_ptr + req)
        n_main = topk
        if HAS_TOPK_LEN:
            n_main = gl.minimum(gl.load(topk_len_ptr + req), topk)
        n_extra = x_topk
        if HAS_EXTRA_LEN:
            n_extra = gl.minimum(gl.load(x_len_ptr + req), x_topk)
        ibase = idx_ptr + req.to(gl.int64) * stride_ib + sq * stride_is
        xibase = xidx_ptr + req.to(gl.int64) * x_stride_ib + sq * x_stride_is
        # this partition's first block (block blk is the request's (it0 + blk - blk0)-th of the walk)
        it0 = it
        first = blk0 + (PART - it0 % NPART + NPART) % NPART
        # the first block's indices; every iteration then loads the next block's (prefetch)
        idx_next = _block_indices(
            first, blk1, mb, ibase, stride_it, n_main, xibase, x_stride_it, n_extra, HAS_EXTRA, ROW8, 0, SUB
        )
        if SUB == 32:
            idx_next_b = _block_indices(
                first, blk1, mb, ibase, stride_it, n_main, xibase, x_stride_it, n_extra, HAS_EXTRA, ROW8, 32, 32
            )
        for blk in range(first, blk1, NPART):
            it = it0 + blk - blk0
            if SUB == 64:
                stage = it % NS
                phase = (it // NS) & 1
                idx8 = idx_next
                idx_next = _block_indices(
                    blk + NPART, blk1, mb, ibase, stride_it, n_main, xibase, x_stride_it, n_extra, HAS_EXTRA, ROW8
                )
                if KV_BF16:
                    _copy_block(idx8, cache, ring, stage, phase, IS_V32, ALIGN, P_WARPS)
                else:
                    c_ptr, c_sblk, c_ntok, c_pbs = _block_cache(blk, mb, cache, xcache, HAS_EXTRA)
                    # every gather of the block is in flight before the wait for a free stage
                    raw, sc, rope, vmask = _gather_block(
                        idx8, c_ptr, c_sblk, c_ntok, c_pbs, stride_tok, IS_V32, PBS_SHIFT, PBS_LOG2, ALIGN, P_WARPS
                    )
                    _stage_block(raw, sc, rope, vmask, ring, stage, phase, IS_V32, P_WARPS)
            else:  # two 32-token halves a block, ring stages 2 it and 2 it + 1
                stage_a = (2 * it) % NS
                phase_a = ((2 * it) // NS) & 1
                stage_b = (2 * it + 1) % NS
                phase_b = ((2 * it + 1) // NS) & 1
                idx_a = idx_next
                idx_b = idx_next_b
                idx_next = _block_indices(
                    blk + NPART, blk1, mb, ibase, stride_it, n_main, xibase, x_stride_it, n_extra, HAS_EXTRA, ROW8,
                    0, 32,
                )  # fmt: skip
                idx_next_b = _block_indices(
                    blk + NPART, blk1, mb, ibase, stride_it, n_main, xibase, x_stride_it, n_extra, HAS_EXTRA, ROW8,
                    32, 32,
                )  # fmt: skip
                if KV_BF16:
                    _copy_block(idx_a, cache, ring, stage_a, phase_a, IS_V32, ALIGN, P_WARPS)
                    _copy_block(idx_b, cache, ring, stage_b, phase_b, IS_V32, ALIGN, P_WARPS)
                else:
                    c_ptr, c_sblk, c_ntok, c_pbs = _block_cache(blk, mb, cache, xcache, HAS_EXTRA)
                    # both halves' gathers are in flight before the wait for the first free stage
                    raw_a, sc_a, rope_a, vmask_a = _gather_block(
                        idx_a, c_ptr, c_sblk, c_ntok, c_pbs, stride_tok, IS_V32, PBS_SHIFT, PBS_LOG2, ALIGN, P_WARPS
                    )
                    raw_b, sc_b, rope_b, vmask_b = _gather_block(
                        idx_b, c_ptr, c_sblk, c_ntok, c_pbs, stride_tok, IS_V32, PBS_SHIFT, PBS_LOG2, ALIGN, P_WARPS
                    )
                    _stage_block(raw_a, sc_a, rope_a, vmask_a, ring, stage_a, phase_a, IS_V32, P_WARPS)
                    _stage_block(raw_b, sc_b, rope_b, vmask_b, ring, stage_b, phase_b, IS_V32, P_WARPS)
        it = it0 + blk1 - blk0
        req += 1
    if KV_BF16 and ALIGN >= 4:  # nothing in flight when the partition ends
        async_copy.commit_group()
        async_copy.wait_group(0)
