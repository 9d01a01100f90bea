"""Combine kernel (step 16 in docs/design.md): LSE-weighted merge of the split-KV partial results.
Twin: :func:`sparse_mla.decode.reference.combine_reference`.

For batch ``i`` with ``n = acc_rows[i+1] - acc_rows[i] > 1`` pieces, partial outputs
``o_j`` (each normalised by its own softmax sum) and log2-space LSEs ``lse_j``::

    m = max_j lse_j,  w_j = exp2(lse_j - m),  out = Σ w_j o_j / Σ w_j,  lse = (log2 Σ w_j + m) · ln 2

then ``attn_sink`` scales ``out`` by ``1 / (1 + exp2(sink·log2e - log2-lse))`` once, and a query
with no valid key anywhere (all ``lse_j = -inf``) gets ``out = 0``, ``lse = +inf``. Batches with
fewer than two rows (a single piece) were finished by the decode kernel and are left alone.
``acc_rows`` is the scheduler's prefix of accumulator rows (:class:`~sparse_mla.decode.scheduler.ScheduleTable`;
FlashMLA's ``num_splits`` prefix also works, with more rows).

The split-KV buffers are made by :func:`sparse_mla.decode.workspace.split_accumulators`; the
final-row formula the decode kernels share with this one is :func:`final_out_lse`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.env import cdiv, cuda_num_sms, interpreting, require_runnable
from ...core.launcher import launch as launch_kernel
from ...core.target import pdl_enabled


@triton.jit
def final_out_lse(acc, row_sum, row_max, sink_log2, HAS_SINK: tl.constexpr):
    """Final ``(out, natural-log lse)`` rows of a softmax with log2-space running max ``m = row_max``,
    sum ``l = row_sum = Σ exp2(s - m)`` and ``acc = Σ exp2(s - m) v``: ``out = acc / (l + exp2(sink - m))``,
    ``lse = (log2 l + m) ln 2``; a row with ``l == 0`` (no valid key) gets out 0 and lse +inf,
    a NaN ``l`` (a NaN or +inf score) NaN."""
    lonely = row_sum == 0.0
    l_safe = tl.where(lonely, 1.0, row_sum)
    m_safe = tl.where(lonely, 0.0, row_max)
    denom = l_safe
    if HAS_SINK:
        denom += tl.exp2(sink_log2 - m_safe)
    o = tl.where(lonely[:, None], 0.0, acc / denom[:, None])
    lse = tl.where(lonely, float("inf"), (tl.log2(l_safe) + m_safe) * 0.6931471805599453)
    return o, lse


@triton.jit
def _combine_kernel(
    oacc_ptr,
    stride_ar,
    stride_as,
    stride_ah,
    lacc_ptr,
    stride_lr,
    stride_lsq,
    stride_lh_acc,
    nsplit_ptr,
    list_ptr,
    sink_ptr,
    out_ptr,
    stride_ob,
    stride_os,
    stride_oh,
    lse_ptr,
    stride_lb,
    stride_lh,
    stride_ls,
    h_q,
    s_q,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINK: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    PDL: tl.constexpr = False,
    LISTED: tl.constexpr = False,
):
    """One program: one (batch, query token), BLOCK_H heads, BLOCK_D output columns; ``LISTED``:
    the batch is entry ``program_id(0)`` of ``list_ptr`` (``[count, batches...]``), none past the count.

    ``BLOCK_S == 1``: the LSEs of 32 splits are read as one tile (max, then sum), then the partial
    outputs one split a step (a pipelined loop). ``BLOCK_S > 1`` (requests with many splits, at
    small batch): BLOCK_S splits at a time, their LSEs and partial outputs as two tiles whose loads
    are all in flight together, merged with an online max."""
    req = tl.program_id(0)
    listed_here = True
    if LISTED:  # program k merges the k-th split batch of the list, if there are that many
        listed_here = req < tl.load(list_ptr)
        req = tl.load(list_ptr + 1 + req, mask=listed_here, other=0)
    sq = tl.program_id(1) % s_q
    # out / lse offsets in int64: a view's strides can take them past 2^31 elements
    req64 = req.to(tl.int64)
    sq64 = sq.to(tl.int64)
    hb = tl.program_id(1) // s_q
    db = tl.program_id(2)
    start = tl.load(nsplit_ptr + req)
    n = tl.load(nsplit_ptr + req + 1) - start
    if LISTED:
        n = tl.where(listed_here, n, 0)
    if PDL:  # a programmatic dependent of the decode: its partials are read only after it completed
        tl.extra.cuda.gdc_wait()
    if n > 1:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < h_q
        cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
        lbase = lacc_ptr + sq * stride_lsq + heads * stride_lh_acc
        obase = oacc_ptr + sq * stride_as + heads[:, None] * stride_ah + cols[None, :]
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        tot = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        # a split with no valid key (lse -inf, weight 0) adds nothing, whatever its row holds; a
        # NaN lse_j (from a NaN or +inf score) makes the sum NaN: NaN propagates
        if BLOCK_S == 1:
            j0 = 0
            while j0 < n:
                js = j0 + tl.arange(0, 32)
                lt = tl.load(
                    lbase[None, :] + (start + js).to(tl.int64)[:, None] * stride_lr,
                    mask=(js < n)[:, None] & hmask[None, :],
                    other=float("-inf"),
                )
                m = tl.maximum(m, tl.max(lt, axis=0))
                j0 += 32
            m = tl.where(m == float("-inf"), 0.0, m)
            if FOR_LOOP:  # compiled: let the pipeliner prefetch the next splits' partial outputs
                for j in tl.range(0, n, num_stages=3):
                    row = (start + j).to(tl.int64)
                    w = tl.exp2(tl.load(lbase + row * stride_lr, mask=hmask, other=float("-inf")) - m)
                    oj = tl.load(obase + row * stride_ar, mask=hmask[:, None], other=0.0)
                    tot += w
                    acc += tl.where((w > 0)[:, None], w[:, None] * oj, 0.0)
            else:  # interpreter (its range() cannot take loaded bounds with NumPy >= 2.4)
                j = 0
                while j < n:
                    row = (start + j).to(tl.int64)
                    w = tl.exp2(tl.load(lbase + row * stride_lr, mask=hmask, other=float("-inf")) - m)
                    oj = tl.load(obase + row * stride_ar, mask=hmask[:, None], other=0.0)
                    tot += w
                    acc += tl.where((w > 0)[:, None], w[:, None] * oj, 0.0)
                    j += 1
        else:
            j0 = 0
            while j0 < n:
                js = j0 + tl.arange(0, BLOCK_S)
                rows = (start + js).to(tl.int64)
                smask = (js < n)[:, None] & hmask[None, :]
                lt = tl.load(lbase[None, :] + rows[:, None] * stride_lr, mask=smask, other=float("-inf"))
                ot = tl.load(obase[None, :, :] + rows[:, None, None] * stride_ar, mask=smask[:, :, None], other=0.0)
                m_new = tl.maximum(m, tl.max(lt, axis=0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_safe)
                w = tl.exp2(lt - m_safe[None, :])
                tot = tot * alpha + tl.sum(w, axis=0)
                acc = acc * alpha[:, None] + tl.sum(tl.where((w > 0)[:, :, None], w[:, :, None] * ot, 0.0), axis=0)
                m = m_new
                j0 += BLOCK_S
            m = tl.where(m == float("-inf"), 0.0, m)
        # no valid key in any split: every lse_j is -inf and the sum is 0, a lonely query for
        # final_out_lse
        sink_log2 = tl.zeros([BLOCK_H], tl.float32)
        if HAS_SINK:
            sink_log2 = tl.load(sink_ptr + heads, mask=hmask, other=float("-inf")) * 1.4426950408889634
        o, lse = final_out_lse(acc, tot, m, sink_log2, HAS_SINK)
        tl.store(
            out_ptr + req64 * stride_ob + sq64 * stride_os + heads.to(tl.int64)[:, None] * stride_oh + cols[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=hmask[:, None],
        )
        if db == 0:
            tl.store(lse_ptr + req64 * stride_lb + heads.to(tl.int64) * stride_lh + sq64 * stride_ls, lse, mask=hmask)


#: fp32 values of one program's partial outputs in flight (BLOCK_S x BLOCK_H x BLOCK_D): 64 registers
#: per thread at 4 warps
_TILE_VALUES = 8192
#: a request with at least this many splits is merged 32 splits a step (the split tile)
MANY_SPLITS = 24


def _is_pow2(v: object) -> bool:
    """``v`` is an int (not a bool) that is a power of two >= 1."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


def _combine_blocks(
    b: int,
    s_q: int,
    h_q: int,
    d_v: int,
    device: torch.device,
    max_pieces: int | None = None,
    blocks: tuple[int, int] | None = None,
) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_D, BLOCK_S) of the combine grid: 16 x 128 by default; when that gives fewer
    than two programs per SM (small batches, whose few requests each have many splits: b = 1 had 32
    programs for 132 SMs and took 9.6 µs on the H200), halve the tile down to 4 x 64 until it does.
    BLOCK_S (splits read at once): 32 when some request has at least :data:`MANY_SPLITS` splits
    (``max_pieces``) and the tile allows (b = 1, h_q 128: 7.6 -> 4.4 µs on the H200), else 1 (at
    b = 2 with 11 splits per request the split tile took 10.0 µs against the loop's 5.3)."""
    block_h, block_d = blocks if blocks is not None else (16, 128)
    if device.type == "cuda" and blocks is None:
        target = 2 * cuda_num_sms(device)
        while b * s_q * cdiv(h_q, block_h) * (d_v // block_d) < target:
            if block_d > 64:
                block_d //= 2
            elif block_h > 4:
                block_h //= 2
            else:
                break
    many = max_pieces is not None and max_pieces >= MANY_SPLITS
    return block_h, block_d, (max(min(32, _TILE_VALUES // (block_h * block_d)), 1) if many else 1)


def combine_fwd(
    o_accum: torch.Tensor,
    lse_accum: torch.Tensor,
    acc_rows: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_sink: torch.Tensor | None = None,
    blocks: tuple[int, int] | None = None,
    max_pieces: int | None = None,
    splits_per_step: int | None = None,
    pdl: bool = False,
    split_list: torch.Tensor | None = None,
) -> None:
    """Merge split partial results into ``out``/``lse`` in place (twin: ``reference.combine_reference``).

    Raises:
        ValueError: ``blocks`` not two powers of two with BLOCK_D dividing d_v, or d_v not a
            multiple of the tile.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.

    Args:
        o_accum: ``[rows, s_q, h_q, d_v]`` fp32 partial outputs (last dim contiguous).
        lse_accum: ``[rows, s_q, h_q]`` fp32 log2-space partial LSEs.
        acc_rows: ``[b + 1]`` int32 prefix sums of accumulator rows per batch (batch i's pieces
            are rows ``acc_rows[i] .. acc_rows[i+1]-1``; fewer than two: left alone).
        out: ``[b, s_q, h_q, d_v]`` bf16 (or fp32) output, written for split batches only (last
            dim contiguous; other strides and every stride of the other tensors are honoured).
        lse: ``[b, h_q, s_q]`` fp32 natural-log LSE, written for split batches only.
        attn_sink: ``[h_q]`` fp32 or None.
        blocks: ``(BLOCK_H, BLOCK_D)`` of one program (powers of two, BLOCK_D dividing d_v);
            default: chosen from the problem size and the GPU (:func:`_combine_blocks`).
        max_pieces: the most rows of one batch (a hint for how many splits a program reads at
            once; any number of rows is merged correctly whatever it is).
        splits_per_step: force the splits merged per step (a power of two; tests and tuning).
        pdl: launch as the programmatic dependent of the kernel before it on the stream (which
            must write the partials; the Hopper decode, which signals after its stores): the
            programs wait for it to complete before reading anything it wrote. Only where
            :func:`sparse_mla.core.target.pdl_enabled` holds (sm_90+, not the interpreter).
        split_list: ``[k + 1]`` int32 contiguous, ``[count, batches...]``: the split batches
            (:attr:`sparse_mla.decode.scheduler.ScheduleTable.split_list`, at most ``k``), on
            the device; the grid then has ``k`` program rows instead of ``b``, most of which,
            with no list, would find their batch unsplit and exit. None: one row per batch.
    """
    b, s_q, h_q, d_v = out.shape
    if not out.is_cuda and not interpreting():
        raise RuntimeError(
            "combine_fwd: needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors "
            "(reference.combine_reference is the PyTorch twin)"
        )
    require_runnable(_combine_kernel, out.device)
    if blocks is not None:
        ok = isinstance(blocks, tuple) and len(blocks) == 2 and all(_is_pow2(v) for v in blocks)
        if not ok or d_v % blocks[1]:
            raise ValueError(
                f"blocks: expected (BLOCK_H, BLOCK_D), powers of two >= 1 with BLOCK_D dividing "
                f"d_v={d_v}, got {blocks!r}"
            )
    # one program row per batch, or per entry of the list of split batches; the tile is sized for
    # the batches that can be split (at most b): sized for the list's length, a b = 1 step kept the
    # 16 x 128 tile, 32 programs for 132 SMs merging ~132 splits each (104 µs against 22, H100)
    rows = b if split_list is None else split_list.shape[0] - 1
    block_h, block_d, block_s = _combine_blocks(min(b, rows), s_q, h_q, d_v, out.device, max_pieces, blocks)
    if splits_per_step is not None:
        if not _is_pow2(splits_per_step):
            raise ValueError(f"splits_per_step: expected a power of two >= 1, got {splits_per_step!r}")
        block_s = splits_per_step
    if d_v % block_d:
        raise ValueError(f"out: d_v must be a multiple of {block_d}, got {d_v}")
    grid = (rows, s_q * cdiv(h_q, block_h), d_v // block_d)
    args = (
        o_accum,
        o_accum.stride(0),
        o_accum.stride(1),
        o_accum.stride(2),
        lse_accum,
        lse_accum.stride(0),
        lse_accum.stride(1),
        lse_accum.stride(2),
        # read as dense arrays: views (strided, expanded, offset) become copies, on the device
        acc_rows.contiguous(),
        split_list if split_list is not None else acc_rows,
        attn_sink.contiguous() if attn_sink is not None else lse_accum,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse,
        lse.stride(0),
        lse.stride(1),
        lse.stride(2),
        h_q,
        s_q,
    )
    pdl = bool(pdl) and pdl_enabled(out.device)
    consts = dict(
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_S=block_s,
        HAS_SINK=attn_sink is not None,
        FOR_LOOP=not interpreting(),
        PDL=pdl,
        LISTED=split_list is not None,
    )
    # launch_pdl only where PDL is on: AMD's backend has no such launch option (it rejects the name)
    launch_kernel(_combine_kernel, grid, args, consts, {"num_warps": 4, **({"launch_pdl": True} if pdl else {})})
