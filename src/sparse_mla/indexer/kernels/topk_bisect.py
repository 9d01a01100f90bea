"""The top-k of rows of up to 32K entries: the k-th best key found bit by bit on keys held in
registers (:func:`_bisect_down`), then the keys at or above it gathered into a list and finished
there.

The register path (:func:`_topk_bisect_kernel`) holds a whole row in one program's registers:
256 rows of 32K run as two waves of one program an SM, each a chain of ~30 CTA-wide sums with the
memory idle after the row's load. The split path spreads the row's read over the whole GPU and
keeps the chains short:
(1) ``_topk_threshold_kernel`` (one program a row) bisects a fixed sample of the row (SAMPLE_G
    segments of SAMPLE_L entries evenly spread over ``[lo, hi)``) for a threshold ``T`` the
    row's keys should pass about ``(kk + CAP) / 2`` times (every valid key when the range holds
    at most ``CAP``);
(2) ``_topk_split_pos_kernel``, grid ``(rows, chunks)``, streams the row and writes the rank keys
    (key and position) of its keys at or above ``T``, in position order, into the chunk's part of
    a buffer, and their count (each launch after the first a programmatic dependent of the one
    before on Hopper, the threshold's letting the row loads start at once);
(3) ``_topk_list_kernel`` (one program a row) reads the row's counts: when ``kk <= count <=
    CAP`` (every key of the top ``kk`` is at or above ``T``: exact) it gathers the list, finds the
    k-th key on it (from the bits all candidates share) and writes the output as the register
    path's list does; otherwise (none, unless the sample misjudged the row: ties spanning the
    threshold, or a row whose top keys the sample missed) it flags the row and does it itself by
    the radix select over the row from memory (slow, and light on registers: the kernel keeps two
    programs an SM; measured 1.3-1.9 µs faster than a register-path launch for the flagged rows
    after it, which cost ~3.4 µs with nothing to do).
The set is the same as the register path's in every case (the same tie rule); the unsorted order
is the same on every call, but not the register path's (the list's slots are taken thread by
thread, :func:`_column_slots`, over other layouts).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.paging import table_slots
from .topk_radix import (
    _emit_topk,
    _load_keys,
    _radix_kth,
    _rank_keys,
    _row_bounds,
    _row_chunk,
    _scalar_positions,
    _select_pass,
    _unrank,
)


@triton.jit
def _bisect_down(ukey, kth, cnt, b, kk, stop, END: tl.constexpr = 32):
    """Bits ``b..END-1`` (from the top) of the k-th best key, while more than ``stop`` keys are at or
    above it: ``kth`` holds the bits found (the largest value with at least ``kk`` keys of ``ukey``
    at or above it so far), ``cnt`` how many are. A bit is a count of the keys at or above
    ``kth | bit``: a compare and an add per entry, no histogram. Returns ``(kth, cnt, b)``."""
    while (b < END) & (cnt > stop):
        cand = kth | (tl.full([], 0x80000000, tl.uint32) >> b.to(tl.uint32))
        c = tl.sum((ukey >= cand).to(tl.int32))
        kth = tl.where(c >= kk, cand, kth)
        cnt = tl.where(c >= kk, c, cnt)
        b += 1
    return kth, cnt, b


@triton.jit
def _f16x2_ge(p, c, ASM: tl.constexpr):
    """Per 16-bit lane of int32 ``p`` / ``c`` (fp16 bit patterns of whole lanes up to 0x3FFF):
    ``p >= c`` as fp16 1.0 / 0.0 (``ASM``: one ``set.ge.f16x2``; else the same comparison as
    integer lanes 1 / 0, for Triton's interpreter, which runs no PTX)."""
    if ASM:
        return tl.inline_asm_elementwise("set.ge.f16x2.f16x2 $0, $1, $2;", "=r,r,r", [p, c], tl.int32, True, 1)
    else:
        return ((p & 0xFFFF) >= (c & 0xFFFF)).to(tl.int32) + ((p >> 16) >= (c >> 16)).to(tl.int32) * 65536


@triton.jit
def _f16x2_add(a, b):
    return tl.inline_asm_elementwise("add.f16x2 $0, $1, $2;", "=r,r,r", [a, b], tl.int32, True, 1)


@triton.jit
def _f16x2_lanes(a, ASM: tl.constexpr):
    """The sum of the two lanes of ``a`` (fp16 whole numbers up to 2048; without ``ASM`` the
    integer lanes of :func:`_f16x2_ge`'s stand-in) as an int32."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 l, h; mov.b32 {l, h}, $1; add.f16 l, l, h; cvt.rni.s32.f16 $0, l; }",
            "=r,r",
            [a],
            tl.int32,
            True,
            1,
        )
    else:
        return (a & 0xFFFF) + (a >> 16)


@triton.jit
def _bisect_down16(ukey, kth, cnt, b, kk, stop, THREADS: tl.constexpr, ASM: tl.constexpr):
    """:func:`_bisect_down` for bits ``b..14`` (``b >= 1``: the top bit is found) with two keys a
    32-bit register: each key's bits 30..17 as a 14-bit lane (0x3FFF for keys whose top bit is
    above the k-th's, 0 for those below: the same counts as the 32-bit keys, as every candidate
    here has a bit set among 30..17 and none below), compared two at a time as fp16 bit patterns
    (all finite and ordered as the integers) by one ``set.ge.f16x2`` and summed within the thread
    by ``add.f16x2`` (at most ``N_P2 / THREADS / 2`` <= 512 a lane, and fp16 holds whole numbers up
    to 2048: exact): about one instruction a key and bit, where the
    32-bit compare, select and add take ~2.7, two of them on the half-rate integer pipe. Without
    ``ASM`` (Triton's interpreter) the lanes are compared and summed as integers."""
    top = kth & 0x80000000
    v = tl.where((ukey & 0x80000000) == top, (ukey >> 17) & 0x3FFF, tl.where(ukey > (top | 0x7FFFFFFF), 0x3FFF, 0))
    return _bisect_packed(_pair_lanes(v.to(tl.int32), THREADS), kth, cnt, b, kk, stop, ASM)


@triton.jit
def _pair_lanes(v, THREADS: tl.constexpr):
    """16-bit values ``v`` (one an entry, the row layout) two a register: entries ``2a`` and ``2a + 1``
    of a thread in the low and high half of word ``a`` (``[entries / 2 per thread, THREADS]``). The
    high half by a shift: a multiply would overflow int32 for values of 0x8000 or more (the keys'
    top halves), which debug builds check."""
    v3 = tl.reshape(v, [v.shape[0] // THREADS // 2, 2, THREADS])
    return tl.sum(tl.where(tl.arange(0, 2)[None, :, None] == 0, v3, v3 << 16), axis=1)


@triton.jit
def _bisect_packed(packed, kth, cnt, b, kk, stop, ASM: tl.constexpr):
    """The loop of :func:`_bisect_down16` on the 14-bit lanes ``packed`` (two a register)."""
    while (b < 15) & (cnt > stop):
        cand = kth | (tl.full([], 0x80000000, tl.uint32) >> b.to(tl.uint32))
        c14 = ((cand >> 17) & 0x3FFF).to(tl.int32)
        ge = _f16x2_ge(packed, tl.zeros(packed.shape, tl.int32) + (c14 | (c14 << 16)), ASM)
        if ASM:
            c = tl.sum(_f16x2_lanes(tl.reduce(ge, 0, _f16x2_add), ASM))
        else:  # (integer lanes of at most 512 a thread: one int32 sum adds both without carries)
            c = tl.sum(_f16x2_lanes(tl.sum(ge, 0), ASM))
        kth = tl.where(c >= kk, cand, kth)
        cnt = tl.where(c >= kk, c, cnt)
        b += 1
    return kth, cnt, b


@triton.jit
def _column_slots(sel, THREADS: tl.constexpr):
    """Slots ``0..`` of the ``True`` entries of ``sel`` taken thread by thread, for the layout of
    :func:`_scalar_positions` (entry ``i * THREADS + t`` in thread ``t``): scans within each thread
    and one over the ``THREADS`` thread totals, in place of a scan across threads for each step of
    the tensor."""
    f = tl.reshape(sel.to(tl.int32), [sel.shape[0] // THREADS, THREADS])
    col = tl.sum(f, axis=0)
    return tl.reshape((tl.cumsum(col, axis=0) - col)[None, :] + tl.cumsum(f, axis=0) - f, [sel.shape[0]])


@triton.jit
def _finish_from_list(
    row_ptr, cand, cnt, kth, b, kk, scr, emit, CAP: tl.constexpr, THREADS: tl.constexpr, TIE_BITS: tl.constexpr,
    N_P2: tl.constexpr, DIRECT: tl.constexpr, SLOTS: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    """On the list of the ``cnt`` positions whose keys are at or above ``kth`` (``b`` bits found;
    ``cand`` holds them as int32, their keys loaded from the row ``row_ptr`` again): the remaining bits,
    the tie cut (the lowest positions among keys equal to the k-th) and the selected keys into the
    scratch (:func:`_topk_bisect_kernel`), or (``DIRECT``: the unsorted output, in the same slots
    :func:`_emit_topk` would copy them to) their positions or (``SLOTS``) cache slots straight into
    the output row, ``emit = (out_row, k, table_row, n_log, pbs)``, with ``-1`` in its columns
    ``kk .. min(k, K_P2) - 1``: no scratch stores and loads between the list and the output."""
    tl.debug_barrier()  # every thread's candidates before any thread's loads
    # the list's positions (int32), their keys from the row again (L2: it was read just before)
    c_i, c_off = _scalar_positions(0, (cnt >= 0).to(tl.int32), CAP, THREADS)  # (as the row's)
    c_valid = c_i < cnt
    c_pos = tl.load(cand.to(tl.pointer_type(tl.int32)) + c_off, mask=c_valid, other=0)
    c_key, c_ukey = _load_keys(row_ptr, c_pos.to(tl.int64), c_valid)
    c_ukey = tl.where(c_valid, c_ukey, 0)
    _finish_keys(c_pos, c_valid, c_key, c_ukey, cnt, kth, b, kk, scr, emit, THREADS, TIE_BITS, N_P2, DIRECT, SLOTS,
                 K_P2)  # fmt: skip


@triton.jit
def _finish_keys(
    c_pos, c_valid, c_key, c_ukey, cnt, kth, b, kk, scr, emit, THREADS: tl.constexpr, TIE_BITS: tl.constexpr,
    N_P2: tl.constexpr, DIRECT: tl.constexpr, SLOTS: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    """:func:`_finish_from_list` on a list in registers (the layout of :func:`_scalar_positions`):
    positions ``c_pos``, ``c_valid``, keys ``c_key`` / ``c_ukey`` (0 where not valid), ``cnt`` of
    them at or above ``kth`` whose top ``b`` bits are the k-th key's."""
    kth, cnt, b = _bisect_down(c_ukey, kth, cnt, b, kk, kk)
    # the entries above the k-th key, and of those equal to it the `need` lowest positions
    # (tie key N_P2 - position among them, 0 for the rest: the largest `need` of it)
    n_gt = tl.sum((c_ukey > kth).to(tl.int32))
    eq = c_valid & (c_ukey == kth)
    tie = tl.where(eq, N_P2 - c_pos, 0).to(tl.uint32)
    cut = tl.zeros([], tl.uint32)
    if cnt > kk:  # (only when all 32 bits are found: then kk > n_gt)
        b = tl.full([], 31 - TIE_BITS, tl.int32)  # tie keys are at most N_P2
        cut, _c, _b = _bisect_down(tie, cut, cnt - n_gt, b, kk - n_gt, kk - n_gt)
    take = (c_ukey > kth) | (eq & (tie >= cut))
    slots = _column_slots(take, THREADS)
    if DIRECT:
        out_row, k, bt_row, n_log, pbs = emit
        res = c_pos.to(tl.int64)
        if SLOTS:
            res = table_slots(res, bt_row, 1, n_log, pbs, take)
        tl.store(out_row + slots, res.to(tl.int32), mask=take)
        rank = tl.arange(0, K_P2)
        tl.store(out_row + rank, tl.full([K_P2], -1, tl.int32), mask=(rank >= kk) & (rank < k))
    else:
        tl.store(scr + slots, _rank_keys(c_key, c_pos), mask=take)


@triton.jit
def _list_or_select(
    row_ptr, lo, hi, pos, ukey, kth, cnt, b, kk, cand_row, scr, emit, CAP: tl.constexpr, THREADS: tl.constexpr,
    TIE_BITS: tl.constexpr, N_P2: tl.constexpr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr, DIRECT: tl.constexpr,
    SLOTS: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    """After the top bits on the row's 32-bit keys ``ukey``: at most ``CAP`` positions of keys at or above ``kth``
    gathered into the row's candidate list (``cand_row = (cand_ptr, r, stride_cr)``) and finished
    there (:func:`_finish_from_list`), or (all 32 bits found and more than ``CAP`` keys equal to the
    k-th) the select pass over the row. Returns 1 where the output row is written (``DIRECT`` and
    the list), else 0 (the scratch holds the selected keys for :func:`_emit_topk`)."""
    written = tl.zeros([], tl.int32)
    if cnt <= CAP:
        sel = ukey >= tl.maximum(kth, 1)
        cand = cand_row[0] + cand_row[1].to(tl.int64) * cand_row[2]
        tl.store(cand.to(tl.pointer_type(tl.int32)) + _column_slots(sel, THREADS), pos, mask=sel)
        _finish_from_list(row_ptr, cand, cnt, kth, b, kk, scr, emit, CAP, THREADS, TIE_BITS, N_P2, DIRECT, SLOTS, K_P2)
        if DIRECT:
            written += 1
    else:
        n_gt = tl.sum((ukey > kth).to(tl.int32))
        _select_pass(row_ptr, lo, hi, (lo // BLOCK) * BLOCK, kth, kk - n_gt, 0, scr, BLOCK, FOR_LOOP)
    return written


@triton.jit
def _topk_bisect_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, scr_ptr, stride_sr, out_ptr, stride_or, n, k, table, cand_ptr, stride_cr,
    N_P2: tl.constexpr, BLOCK: tl.constexpr, K_P2: tl.constexpr, CAP: tl.constexpr, THREADS: tl.constexpr,
    TIE_BITS: tl.constexpr, SLOTS: tl.constexpr, SORTED: tl.constexpr, FOR_LOOP: tl.constexpr,
    PACK16: tl.constexpr, INSIDE: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Grid ``(rows,)``, rows of at most ``N_P2`` entries (``2^TIE_BITS``), ``THREADS`` threads a program: the row's
    keys read once into registers (entry ``i`` of thread ``t``: position ``i * THREADS + t``); the
    k-th best key's top bits found bit by bit (:func:`_bisect_down`) only until at most ``CAP`` keys
    are at or above them; their positions gathered thread by thread (:func:`_column_slots`) into
    ``cand[r]`` (as int32: 4 bytes an entry, where 8-byte rank keys made ptxas spill every key
    before the stores; the keys are loaded from the row again, from L2); on that list, the remaining bits, then (when more keys equal the k-th than the top k
    has room for) the lowest positions among them by the same bisection, and the selected keys
    gathered into the scratch; the output as :func:`_topk_kernel` (without ``SORTED``: in the
    gathered order, the same on every call). More than ``CAP`` keys equal to the k-th (all 32 bits
    found) take the select pass over the row instead. ``table``: ``(bt_ptr, stride_bt, n_log, pbs,
    next_n)`` (``SLOTS``). ``PACK16``: bits 1..14 two keys a register (:func:`_bisect_down16`; rows of
    two or more entries a thread). ``INSIDE``: the entries a thread holds that lie inside the row for
    certain (their loads take no mask, :func:`_row_chunk`). ``ASM``: the packed fp16 comparisons as
    inline PTX (compiled for NVIDIA; AMD and the interpreter compare the lanes as integers)."""
    tl.static_assert(N_P2 % THREADS == 0 and CAP % THREADS == 0, "rows and lists fill every thread")
    tl.static_assert(not PACK16 or N_P2 >= 2 * THREADS, "two keys a thread to pack")
    bt_ptr, stride_bt, n_log, pbs, next_n = table
    r = tl.program_id(0)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    scr = scr_ptr + r.to(tl.int64) * stride_sr
    out_row = out_ptr + r.to(tl.int64) * stride_or
    written = tl.zeros([], tl.int32)
    if kk > 0:
        pos, valid, _key, ukey = _row_chunk(row_ptr, 0, lo, hi, N_P2, SCALAR=THREADS, n_row=n, INSIDE=INSIDE)
        ukey = tl.where(valid, ukey, 0)  # (0: out of range)
        # the top bits: cnt = valid keys >= kth (every key's is > 0, so kth 0 counts them all)
        if PACK16:  # the top bit, then bits 1..14 two keys a register, then the rest
            kth, cnt, b = _bisect_down(ukey, tl.zeros([], tl.uint32), hi - lo, tl.zeros([], tl.int32), kk, CAP, 1)
            if cnt > CAP:
                kth, cnt, b = _bisect_down16(ukey, kth, cnt, b, kk, CAP, THREADS, ASM)
            kth, cnt, b = _bisect_down(ukey, kth, cnt, b, kk, CAP)
        else:
            kth, cnt, b = _bisect_down(ukey, tl.zeros([], tl.uint32), hi - lo, tl.zeros([], tl.int32), kk, CAP)
        emit = (out_row, k, bt_ptr + (r // next_n).to(tl.int64) * stride_bt, n_log, pbs)
        written = _list_or_select(
            row_ptr, lo, hi, pos, ukey, kth, cnt, b, kk, (cand_ptr, r, stride_cr), scr, emit, CAP, THREADS,
            TIE_BITS, N_P2, BLOCK, FOR_LOOP, not SORTED, SLOTS, K_P2,
        )  # fmt: skip
    if written == 0:
        _emit_topk(scr, r, kk, k, out_ptr, stride_or, bt_ptr, stride_bt, n_log, pbs, next_n, K_P2, SLOTS, SORTED)


@triton.jit
def _topk_threshold_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, t_ptr, n, k, CAP: tl.constexpr, SAMPLE_G: tl.constexpr,
    SAMPLE_L: tl.constexpr, END: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(rows,)``: ``t[r]`` (int32 bits of a uint32 key) the largest ``END``-bit prefix with at
    least ``ceil(target * S / (hi - lo))`` of the row's ``S = SAMPLE_G * SAMPLE_L`` sample keys at or
    above it, ``target = (kk + CAP) // 2``; 1 (every valid key) when ``hi - lo <= CAP``. ``PDL``: the
    positions kernel (a programmatic dependent) may start at once: its row loads do not need ``t``."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    nv = hi - lo
    t = tl.full([], 1, tl.uint32)
    if nv > CAP:  # (CAP >= S: the segments are disjoint and inside [lo, hi))
        S: tl.constexpr = SAMPLE_G * SAMPLE_L
        seg = (tl.arange(0, SAMPLE_G) * nv) // SAMPLE_G
        spos = tl.reshape(lo + seg[:, None] + tl.arange(0, SAMPLE_L)[None, :], [S])
        _key, sukey = _load_keys(row_ptr, spos.to(tl.int64), spos < hi)
        rs = ((kk + CAP) // 2 * S + nv - 1) // nv
        kth, _c, _b = _bisect_down(sukey, tl.zeros([], tl.uint32), tl.full([], S, tl.int32), tl.zeros([], tl.int32),
                                   rs, rs, END)  # fmt: skip
        t = tl.maximum(kth, 1)
    tl.store(t_ptr + r, t.to(tl.int32, bitcast=True))


@triton.jit
def _topk_split_pos_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, t_ptr, rk_ptr, stride_kr, cnt_ptr, stride_cr, n,
    CHUNK: tl.constexpr, THREADS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(rows, chunks)``: the rank keys (:func:`_rank_keys`: key and position, so that the list
    needs no gathers from the row, which L2 no longer holds) of chunk ``c``'s valid keys at or above
    ``t[r]``, in position order, at ``rk[r, c * CHUNK:]``, and their count at ``cnt[r, c]``. ``PDL``:
    a programmatic dependent of :func:`_topk_threshold_kernel`, waiting for ``t`` after its loads."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, _kk = _row_bounds(lo_ptr, hi_ptr, r, n, 1)
    start = c * CHUNK
    if start + CHUNK <= n:  # (every load inside the row: no masks, all of them in flight)
        pos, valid, key, ukey = _row_chunk(row_ptr, start, lo, hi, CHUNK, THREADS, n, CHUNK // THREADS)
    else:
        pos, valid, key, ukey = _row_chunk(row_ptr, start, lo, hi, CHUNK, THREADS, n, 0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.load(t_ptr + r).to(tl.uint32, bitcast=True)
    sel = valid & (ukey >= t)
    dst = rk_ptr + r.to(tl.int64) * stride_kr + start
    tl.store(dst + _column_slots(sel, THREADS), _rank_keys(key, pos), mask=sel)
    tl.store(cnt_ptr + r.to(tl.int64) * stride_cr + c, tl.sum(sel.to(tl.int32)))


@triton.jit
def _max_pair(a0, a1, b0, b1):
    return tl.maximum(a0, b0), tl.maximum(a1, b1)


@triton.jit
def _topk_list_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, rk_ptr, stride_kr, cnt_ptr, stride_cr, flag_ptr, scr_ptr, stride_sr,
    out_ptr, stride_or, n, k, table,
    NCH: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr, THREADS: tl.constexpr, TIE_BITS: tl.constexpr,
    N_P2: tl.constexpr, K_P2: tl.constexpr, SLOTS: tl.constexpr, SORTED: tl.constexpr, PDL: tl.constexpr,
    BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    """Grid ``(rows,)``: the row's list from :func:`_topk_split_pos_kernel` (``NCH`` chunks' parts,
    in position order) when it holds ``kk..CAP`` entries, finished as the register path's list
    (:func:`_finish_keys`) from the bits every entry shares; ``flag[r]`` 1 (the list does not hold
    the top ``kk``, or exceeds ``CAP``) or 0. ``PDL``: a
    programmatic dependent of the positions kernel. A flagged row is done here too, by the radix
    select over the row (``x_ptr``) from memory, ``BLOCK`` entries a step (four 8-bit passes and the
    select: slow, rare, and light on registers), so that no launch follows. ``table``: ``(bt_ptr,
    stride_bt, n_log, pbs, next_n)`` (``SLOTS``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    bt_ptr, stride_bt, n_log, pbs, next_n = table
    r = tl.program_id(0)
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    scr = scr_ptr + r.to(tl.int64) * stride_sr
    out_row = out_ptr + r.to(tl.int64) * stride_or
    flag = tl.zeros([], tl.int32)
    written = tl.zeros([], tl.int32)
    if kk > 0:
        # list entry i lies in the chunk part holding it: i plus the unused slots of the parts before
        i, _off = _scalar_positions(0, (kk > 0).to(tl.int32), CAP, THREADS)
        off = i
        total = tl.zeros([], tl.int32)
        prev = tl.zeros([], tl.int32)
        for c in tl.static_range(NCH):
            cnt_c = tl.load(cnt_ptr + r.to(tl.int64) * stride_cr + c)
            if c > 0:
                off += tl.where(i >= total, CHUNK - prev, 0)
            prev = cnt_c
            total += cnt_c
        if (total >= kk) & (total <= CAP):
            c_valid = i < total
            c_pos, c_key, c_ukey = _unrank(tl.load(rk_ptr + r.to(tl.int64) * stride_kr + off, mask=c_valid, other=0))
            c_ukey = tl.where(c_valid, c_ukey, 0)
            # the top bits every entry shares are the k-th key's
            ones = tl.full([], 0xFFFFFFFF, tl.uint32)  # (`~` on uint32 fails in Triton's interpreter)
            mx, nmn = tl.reduce((c_ukey, tl.where(c_valid, c_ukey ^ ones, 0)), 0, _max_pair)
            diff = mx ^ nmn ^ ones
            b = tl.zeros([], tl.int32)
            while (b < 32) & (((diff << tl.minimum(b, 31).to(tl.uint32)) & 0x80000000) == 0):
                b += 1
            kth = tl.where(b >= 32, mx, mx & ((ones >> tl.minimum(b, 31).to(tl.uint32)) ^ ones))
            emit = (out_row, k, bt_ptr + (r // next_n).to(tl.int64) * stride_bt, n_log, pbs)
            _finish_keys(c_pos, c_valid, c_key, c_ukey, total, kth, b, kk, scr, emit, THREADS, TIE_BITS, N_P2,
                         not SORTED, SLOTS, K_P2)  # fmt: skip
            if not SORTED:
                written += 1
        else:
            flag += 1  # the radix select over the row; the output from the scratch below
            row_ptr = x_ptr + r.to(tl.int64) * stride_xr
            c_lo = (lo // BLOCK) * BLOCK
            kth, rem = _radix_kth(row_ptr, lo, hi, c_lo, kk, 8, BLOCK, FOR_LOOP)
            _select_pass(row_ptr, lo, hi, c_lo, kth, rem, 0, scr, BLOCK, FOR_LOOP)
    tl.store(flag_ptr + r, flag)
    if written == 0:
        _emit_topk(scr, r, kk, k, out_ptr, stride_or, bt_ptr, stride_bt, n_log, pbs, next_n, K_P2, SLOTS, SORTED)
