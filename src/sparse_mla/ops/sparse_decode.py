"""Split-KV sparse decode kernel (seed steps 5-14) and its launcher.

One program serves one scheduler partition, one query token (``s_q`` index) and ``BLOCK_H``
query heads. It walks the (batch, 64-index block) pieces the tile scheduler gave its partition;
per block it gathers the 64 indexed tokens of the FP8 paged cache, dequantises them, computes
``QKᵀ`` over ``d_qk``, runs the online softmax in exp2 space and accumulates ``P·V`` over
``d_v = 512`` in fp32. A batch that the scheduler did not split gets its final bf16 ``out`` and
natural-log ``lse`` here (attn_sink applied); pieces of split batches write fp32 partial O and
log2-space LSE for :mod:`sparse_mla.ops.combine`.

Layout of the dequantised key inside the kernel: ``K_main [64, 512]`` (V32: the 512 NoPE values;
MODEL1: 448 NoPE values followed by the 64 RoPE values) and, for V32 only, ``K_tail [64, 64]``
(the RoPE part). ``V = K_main`` in both layouts. Invalid tokens are never loaded (masked loads
with 0 as the fill value), so NaN or garbage in unused cache slots cannot reach P·V.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._runtime import interpreting, require_runnable
from ..interface import DecodeProblem, heads_per_cta
from ..scheduler import TOPK_BLOCK_SIZE, ScheduleTable

LOG2E = 1.4426950408889634
LAZY_RESCALE_DEFAULT = tl.constexpr(os.environ.get("SPARSE_MLA_LAZY_RESCALE", "0") == "1")
LN2 = 0.6931471805599453


@triton.jit
def _load_block_keys(
    kv_ptr, stride_blk, stride_tok, num_tokens, pbs, pbs_log2,
    idx_ptr, stride_ib, stride_is, stride_it,
    req, sq, pos0, n_valid,
    ADDR: tl.constexpr, IS_V32: tl.constexpr, D_MAIN: tl.constexpr, D_NOPE: tl.constexpr, D_TAIL: tl.constexpr,
    TILE: tl.constexpr, MAIN_TILES: tl.constexpr, NUM_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Gather and dequantise one block of 64 indexed tokens: (k_main [N, 512], k_tail [N, 64], valid [N])."""
    offs_n = pos0 + tl.arange(0, BLOCK_N)
    in_list = offs_n < n_valid
    idx = tl.load(idx_ptr + req * stride_ib + sq * stride_is + offs_n * stride_it, mask=in_list, other=-1)
    valid = in_list & (idx >= 0) & (idx < num_tokens)
    safe = tl.where(valid, idx, 0).to(tl.int64)
    # ADDR 0: V32 cache whose blocks are contiguous (token address = idx * stride_tok);
    # 1: power-of-two page_block_size (shift and mask); 2: general (integer division)
    if ADDR == 0:
        blk = safe * 0
        off = safe
    elif ADDR == 1:
        blk = safe >> pbs_log2
        off = safe & (pbs - 1)
    else:
        blk = safe // pbs
        off = safe - blk * pbs
    cols = tl.arange(0, D_MAIN)
    if IS_V32:
        tok = blk * stride_blk + off * stride_tok  # byte offset of each token record
        k8 = tl.load(kv_ptr + tok[:, None] + cols[None, :], mask=valid[:, None], other=0)
        kf = k8.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
        sptr = (kv_ptr + tok + D_NOPE).to(tl.pointer_type(tl.float32))
        tiles = tl.arange(0, MAIN_TILES)
        sc = tl.load(sptr[:, None] + tiles[None, :], mask=valid[:, None], other=0.0)
        # power-of-two scales: the product is exact in bf16
        kf = tl.reshape(tl.reshape(kf, [BLOCK_N, MAIN_TILES, TILE]) * sc.to(DOT_DTYPE)[:, :, None], [BLOCK_N, D_MAIN])
        rptr = (kv_ptr + tok + D_NOPE + 4 * NUM_TILES).to(tl.pointer_type(tl.bfloat16))
        rc = tl.arange(0, D_TAIL)
        k_tail = tl.load(rptr[:, None] + rc[None, :], mask=valid[:, None], other=0.0)
    else:
        base = blk * stride_blk
        tok = base + off * (D_NOPE + 2 * D_TAIL)
        is_nope = cols < D_NOPE
        k8 = tl.load(kv_ptr + tok[:, None] + cols[None, :], mask=valid[:, None] & is_nope[None, :], other=0)
        kf = k8.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
        tiles = tl.arange(0, MAIN_TILES)
        eb = tl.load(kv_ptr + base[:, None] + pbs * (D_NOPE + 2 * D_TAIL) + off[:, None] * 8 + tiles[None, :],
                     mask=valid[:, None] & (tiles[None, :] < NUM_TILES), other=127)
        sc = tl.exp2(eb.to(tl.float32) - 127.0).to(DOT_DTYPE)
        kf = tl.reshape(tl.reshape(kf, [BLOCK_N, MAIN_TILES, TILE]) * sc[:, :, None], [BLOCK_N, D_MAIN])
        rptr = (kv_ptr + tok + D_NOPE).to(tl.pointer_type(tl.bfloat16))
        rc = cols - D_NOPE
        rope = tl.load(rptr[:, None] + rc[None, :], mask=valid[:, None] & (cols[None, :] >= D_NOPE), other=0.0)
        kf = tl.where(is_nope[None, :], kf, rope.to(DOT_DTYPE))
        k_tail = tl.zeros([BLOCK_N, D_TAIL], dtype=tl.bfloat16)
    return kf.to(DOT_DTYPE), k_tail.to(DOT_DTYPE), valid


@triton.jit
def _block_step(
    q_main, q_tail, m_i, l_i, acc,
    kv_ptr, stride_blk, stride_tok, num_tokens, pbs, pbs_log2,
    idx_ptr, stride_ib, stride_is, stride_it,
    req, sq, blk_i, n_valid, scale_log2,
    ADDR: tl.constexpr, IS_V32: tl.constexpr, D_MAIN: tl.constexpr, D_NOPE: tl.constexpr, D_TAIL: tl.constexpr,
    TILE: tl.constexpr, MAIN_TILES: tl.constexpr, NUM_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    RESCALE_TAU: tl.constexpr = 8.0,
):
    """One BLOCK_N-token step of the online softmax; returns the updated (m, l, acc)."""
    k_main, k_tail, valid = _load_block_keys(
        kv_ptr, stride_blk, stride_tok, num_tokens, pbs, pbs_log2,
        idx_ptr, stride_ib, stride_is, stride_it,
        req, sq, blk_i * BLOCK_N, n_valid,
        ADDR, IS_V32, D_MAIN, D_NOPE, D_TAIL, TILE, MAIN_TILES, NUM_TILES, BLOCK_N, DOT_DTYPE,
    )
    s = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PREC)
    if IS_V32:
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=DOT_PREC)
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    # Lazy rescaling: a row's running max moves only when the block's max exceeds it by more than
    # RESCALE_TAU (log2 units), so P stays <= 2^RESCALE_TAU and most steps skip the O(H x 512)
    # rescale of acc. (-inf - -inf is NaN, and NaN > tau is False: rows with nothing valid stay.)
    m_blk = tl.max(s, axis=1)
    grow = (m_blk - m_i) > RESCALE_TAU
    m_new = tl.where(grow, m_blk, m_i)
    alpha = tl.where(grow, tl.exp2(m_i - m_new), 1.0)
    if LAZY_RESCALE_DEFAULT:
        if tl.max(grow.to(tl.int32), axis=0) > 0:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    l_i = l_i * alpha
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    l_i += tl.sum(p, axis=1)
    acc = tl.dot(p.to(DOT_DTYPE), k_main, acc=acc, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_blocks(
    q_main, q_tail, m_i, l_i, acc,
    kv_ptr, stride_blk, stride_tok, num_tokens, pbs, pbs_log2,
    idx_ptr, stride_ib, stride_is, stride_it,
    req, sq, blk_begin, blk_end, n_valid, scale_log2,
    ADDR: tl.constexpr, IS_V32: tl.constexpr, D_MAIN: tl.constexpr, D_NOPE: tl.constexpr, D_TAIL: tl.constexpr,
    TILE: tl.constexpr, MAIN_TILES: tl.constexpr, NUM_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, SCHED_BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    FOR_LOOP: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Online softmax over scheduler blocks [blk_begin, blk_end) of one cache, BLOCK_N tokens a step.

    Compiled, a ``tl.range`` loop lets Triton's pipeliner prefetch the next steps' gathers
    (``NUM_STAGES``); under the interpreter a while loop runs instead (Triton 3.6's interpreter
    cannot take loaded values as range() bounds with NumPy >= 2.4). Returns the updated (m, l, acc).
    """
    sub_begin = blk_begin * (SCHED_BLOCK // BLOCK_N)
    sub_end = blk_end * (SCHED_BLOCK // BLOCK_N)
    if FOR_LOOP:
        for blk_i in tl.range(sub_begin, sub_end, num_stages=NUM_STAGES):
            m_i, l_i, acc = _block_step(
                q_main, q_tail, m_i, l_i, acc, kv_ptr, stride_blk, stride_tok, num_tokens, pbs, pbs_log2,
                idx_ptr, stride_ib, stride_is, stride_it, req, sq, blk_i, n_valid, scale_log2,
                ADDR, IS_V32, D_MAIN, D_NOPE, D_TAIL, TILE, MAIN_TILES, NUM_TILES, BLOCK_N, DOT_DTYPE, DOT_PREC,
            )
    else:
        blk_i = sub_begin
        while blk_i < sub_end:
            m_i, l_i, acc = _block_step(
                q_main, q_tail, m_i, l_i, acc, kv_ptr, stride_blk, stride_tok, num_tokens, pbs, pbs_log2,
                idx_ptr, stride_ib, stride_is, stride_it, req, sq, blk_i, n_valid, scale_log2,
                ADDR, IS_V32, D_MAIN, D_NOPE, D_TAIL, TILE, MAIN_TILES, NUM_TILES, BLOCK_N, DOT_DTYPE, DOT_PREC,
            )
            blk_i += 1
    return m_i, l_i, acc


@triton.jit
def _sparse_decode_kernel(
    q_ptr, stride_qb, stride_qs, stride_qh,
    kv_ptr, stride_kblk, stride_ktok, num_tokens, pbs, pbs_log2,
    idx_ptr, stride_ib, stride_is, stride_it, topk,
    tl_ptr,
    ekv_ptr, stride_eblk, stride_etok, e_num_tokens, e_pbs, e_pbs_log2,
    eidx_ptr, stride_eib, stride_eis, stride_eit, e_topk,
    etl_ptr,
    sink_ptr,
    meta_ptr, nsplit_ptr, mainblk_ptr, nblk_ptr,
    out_ptr, stride_ob, stride_os, stride_oh,
    lse_ptr, stride_lb, stride_lh, stride_ls,
    oacc_ptr, stride_ar, stride_as, stride_ah,
    lacc_ptr, stride_lr, stride_lsq,
    h_q, scale_log2,
    ADDR: tl.constexpr, E_ADDR: tl.constexpr,
    IS_V32: tl.constexpr, D_MAIN: tl.constexpr, D_NOPE: tl.constexpr, D_TAIL: tl.constexpr,
    TILE: tl.constexpr, MAIN_TILES: tl.constexpr, NUM_TILES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SCHED_BLOCK: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_EXTRA_LEN: tl.constexpr, HAS_SINK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, FOR_LOOP: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    part = tl.program_id(0)
    sq = tl.program_id(1)
    hb = tl.program_id(2)
    mrow = meta_ptr + part * 8
    begin_req = tl.load(mrow + 0)
    end_req = tl.load(mrow + 1)
    begin_block = tl.load(mrow + 2)
    end_block = tl.load(mrow + 3)
    begin_split = tl.load(mrow + 4)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    cm = tl.arange(0, D_MAIN)
    ct = tl.arange(0, D_TAIL)
    if HAS_SINK:
        sink_log2 = tl.load(sink_ptr + heads, mask=hmask, other=float("-inf")) * 1.4426950408889634

    req = begin_req
    while req <= end_req:
        blk0 = tl.where(req == begin_req, begin_block, 0)
        blk1 = tl.where(req == end_req, end_block, tl.load(nblk_ptr + req))
        split = tl.where(req == begin_req, begin_split, 0)
        split_base = tl.load(nsplit_ptr + req)
        n_splits = tl.load(nsplit_ptr + req + 1) - split_base
        n_main = tl.load(mainblk_ptr + req)

        qrow = q_ptr + req * stride_qb + sq * stride_qs + heads.to(tl.int64)[:, None] * stride_qh
        q_main = tl.load(qrow + cm[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        if IS_V32:
            q_tail = tl.load(qrow + D_NOPE + ct[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        else:
            q_tail = tl.zeros([BLOCK_H, D_TAIL], dtype=DOT_DTYPE)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D_MAIN], tl.float32)

        n_valid = topk
        if HAS_TOPK_LEN:
            n_valid = tl.minimum(tl.load(tl_ptr + req), topk)
        m_i, l_i, acc = _attend_blocks(
            q_main, q_tail, m_i, l_i, acc,
            kv_ptr, stride_kblk, stride_ktok, num_tokens, pbs, pbs_log2,
            idx_ptr, stride_ib, stride_is, stride_it,
            req, sq, blk0, tl.minimum(blk1, n_main), n_valid, scale_log2,
            ADDR, IS_V32, D_MAIN, D_NOPE, D_TAIL, TILE, MAIN_TILES, NUM_TILES, BLOCK_N, SCHED_BLOCK, DOT_DTYPE, DOT_PREC,
            FOR_LOOP, NUM_STAGES,
        )
        if HAS_EXTRA:
            e_valid = e_topk
            if HAS_EXTRA_LEN:
                e_valid = tl.minimum(tl.load(etl_ptr + req), e_topk)
            m_i, l_i, acc = _attend_blocks(
                q_main, q_tail, m_i, l_i, acc,
                ekv_ptr, stride_eblk, stride_etok, e_num_tokens, e_pbs, e_pbs_log2,
                eidx_ptr, stride_eib, stride_eis, stride_eit,
                req, sq, tl.maximum(blk0, n_main) - n_main, blk1 - n_main, e_valid, scale_log2,
                E_ADDR, IS_V32, D_MAIN, D_NOPE, D_TAIL, TILE, MAIN_TILES, NUM_TILES, BLOCK_N, SCHED_BLOCK, DOT_DTYPE, DOT_PREC,
                FOR_LOOP, NUM_STAGES,
            )

        lonely = l_i == 0.0
        l_safe = tl.where(lonely, 1.0, l_i)
        m_safe = tl.where(lonely, 0.0, m_i)
        lse2 = tl.where(lonely, float("-inf"), tl.log2(l_safe) + m_safe)
        if n_splits == 1:
            denom = l_safe
            if HAS_SINK:
                denom += tl.exp2(sink_log2 - m_safe)
            o = acc / denom[:, None]
            o = tl.where(lonely[:, None], 0.0, o)
            optr = out_ptr + req * stride_ob + sq * stride_os + heads[:, None] * stride_oh + cm[None, :]
            tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
            lse = tl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
            tl.store(lse_ptr + req * stride_lb + heads * stride_lh + sq * stride_ls, lse, mask=hmask)
        else:
            row = (split_base + split).to(tl.int64)
            o = acc / l_safe[:, None]
            aptr = oacc_ptr + row * stride_ar + sq * stride_as + heads[:, None] * stride_ah + cm[None, :]
            tl.store(aptr, o, mask=hmask[:, None])
            tl.store(lacc_ptr + row * stride_lr + sq * stride_lsq + heads, lse2, mask=hmask)
        req += 1


_DEFAULT_TUNE = {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
_STAGE_CAP: dict = {}  # kernel variant -> most pipeline stages that fit in shared memory


def _tuning() -> dict:
    """Launch parameters; ``SPARSE_MLA_TUNE="BLOCK_N=32,num_warps=8"`` overrides them (benchmarks)."""
    tune = dict(_DEFAULT_TUNE)
    for kv in filter(None, os.environ.get("SPARSE_MLA_TUNE", "").split(",")):
        k, v = kv.split("=")
        if k not in tune:
            raise ValueError(f"SPARSE_MLA_TUNE: unknown key {k!r}; known: {sorted(tune)}")
        tune[k] = int(v)
    if TOPK_BLOCK_SIZE % tune["BLOCK_N"]:
        raise ValueError(f"SPARSE_MLA_TUNE: BLOCK_N must divide {TOPK_BLOCK_SIZE}")
    return tune


def _backend() -> str:
    """``SPARSE_MLA_BACKEND``: ``auto`` (default), ``tl`` (portable kernel) or ``gluon`` (Hopper kernel)."""
    b = os.environ.get("SPARSE_MLA_BACKEND", "auto")
    if b not in ("auto", "tl", "gluon"):
        raise ValueError(f"SPARSE_MLA_BACKEND: expected 'auto', 'tl' or 'gluon', got {b!r}")
    return b


def gluon_supported(p: DecodeProblem) -> bool:
    """Whether the warp-specialised Hopper kernel (:mod:`.sparse_decode_gluon`) serves this call:
    compiled (not interpreted) on an sm_90 GPU, V32 layout, no extra cache (any h_q)."""
    dev = p.q.device
    return (
        dev.type == "cuda"
        and not interpreting()
        and torch.cuda.get_device_capability(dev)[0] == 9
        and p.layout.name == "V32"
        and p.extra_k_cache is None
    )


def sparse_decode_fwd(p: DecodeProblem, table: ScheduleTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the split-KV kernel (and the combine kernel when a batch is split).

    On Hopper, calls that :func:`gluon_supported` accepts run the warp-specialised Gluon kernel
    (same contract, measured faster: docs/perf.md); everything else runs the portable ``tl``
    kernel below. ``SPARSE_MLA_BACKEND=tl`` forces the portable kernel, ``=gluon`` the Gluon one
    (``NotImplementedError`` where it does not apply).

    Args:
        p: a validated call (:func:`sparse_mla.interface.validate_sparse_decode`).
        table: the scheduler table on ``p.q``'s device.

    Returns:
        ``out [b, s_q, h_q, 512]`` bf16, ``lse [b, h_q, s_q]`` fp32.
    """
    from .combine import combine_fwd, split_accumulators

    backend = _backend()
    if backend == "gluon" or (backend == "auto" and gluon_supported(p)):
        if not gluon_supported(p):
            raise NotImplementedError(
                "SPARSE_MLA_BACKEND=gluon: the Gluon kernel needs an sm_90 GPU, the V32 layout and no extra cache"
            )
        from .sparse_decode_gluon import sparse_decode_fwd as gluon_fwd

        return gluon_fwd(p, table)
    require_runnable(_sparse_decode_kernel, p.q.device)
    q = p.q
    b, s_q, h_q, _ = q.shape
    lay = p.layout
    dev = q.device
    block_h = heads_per_cta(h_q)
    tune = _tuning()
    n_hb = triton.cdiv(h_q, block_h)
    interp = interpreting()
    # Triton 3.6's interpreter truncates fp32 -> bf16 instead of rounding to nearest even: there
    # the kernels write fp32 and torch rounds once at the end (compiled kernels write bf16).
    out = torch.empty(b, s_q, h_q, p.d_v, dtype=torch.float32 if interp else torch.bfloat16, device=dev)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=dev)
    any_split = table.any_split
    o_acc, l_acc = split_accumulators(b, s_q, h_q, p.d_v, table.num_sm_parts, table.any_split, dev)

    def cache_args(kc):
        raw = kc if kc.dtype == torch.uint8 else kc.view(torch.uint8)
        pbs = raw.shape[1]
        pow2 = pbs & (pbs - 1) == 0
        return raw, raw.stride(0), raw.stride(1), raw.shape[0] * pbs, pbs, pbs.bit_length() - 1 if pow2 else 0

    def addr_mode(kc):
        if lay.name == "V32" and (kc.shape[0] == 1 or kc.stride(0) == kc.shape[1] * kc.stride(1)):
            return 0
        return 1 if kc.shape[1] & (kc.shape[1] - 1) == 0 else 2

    kv = cache_args(p.k_cache)
    has_extra = p.extra_k_cache is not None
    ekv = cache_args(p.extra_k_cache) if has_extra else kv
    eidx = p.extra_indices if has_extra else p.indices
    dummy_i32 = table.num_splits
    is_v32 = lay.name == "V32"
    grid = (table.num_sm_parts, s_q, n_hb)
    args = (
        q, q.stride(0), q.stride(1), q.stride(2),
        *kv, p.indices, *p.indices.stride(), p.indices.shape[2],
        p.topk_length if p.topk_length is not None else dummy_i32,
        *ekv, eidx, *eidx.stride(), eidx.shape[2],
        p.extra_topk_length if p.extra_topk_length is not None else dummy_i32,
        p.attn_sink if p.attn_sink is not None else l_acc,
        table.metadata, table.num_splits, table.main_blocks, table.num_blocks_t,
        out, out.stride(0), out.stride(1), out.stride(2),
        lse, lse.stride(0), lse.stride(1), lse.stride(2),
        o_acc, o_acc.stride(0), o_acc.stride(1), o_acc.stride(2),
        l_acc, l_acc.stride(0), l_acc.stride(1),
        h_q, p.sm_scale * LOG2E,
    )
    consts = dict(
        ADDR=addr_mode(p.k_cache), E_ADDR=addr_mode(p.extra_k_cache) if has_extra else 0,
        IS_V32=is_v32, D_MAIN=512, D_NOPE=lay.d_nope, D_TAIL=64,
        TILE=lay.tile, MAIN_TILES=512 // lay.tile, NUM_TILES=lay.num_tiles,
        BLOCK_H=block_h, BLOCK_N=tune["BLOCK_N"], SCHED_BLOCK=TOPK_BLOCK_SIZE,
        HAS_TOPK_LEN=p.topk_length is not None, HAS_EXTRA=has_extra,
        HAS_EXTRA_LEN=p.extra_topk_length is not None, HAS_SINK=p.attn_sink is not None,
        # the interpreter's bf16 dot is wrong (DESIGN §8): fp32 operands, exact (ieee) products there
        DOT_DTYPE=tl.float32 if interp else tl.bfloat16, DOT_PREC="ieee" if interp else None,
        FOR_LOOP=not interp,
    )
    # a pipelined variant can need more shared memory than the GPU has (seen: MODEL1 with an extra
    # cache, 246 KB at num_stages=2 on an H200): fall back to fewer stages, once per variant
    key = (dev.type, dev.index, tuple(sorted((k, str(v)) for k, v in consts.items())), tune["num_warps"])
    stages = min(tune["num_stages"], _STAGE_CAP.get(key, tune["num_stages"]))
    while True:
        try:
            _sparse_decode_kernel[grid](*args, **consts, NUM_STAGES=stages, num_warps=tune["num_warps"])
            break
        except triton.runtime.errors.OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            _STAGE_CAP[key] = stages
    if any_split:
        combine_fwd(o_acc, l_acc, table.num_splits, out, lse, p.attn_sink)
    return out.to(torch.bfloat16), lse
