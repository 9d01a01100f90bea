"""The top-k's radix select, and what every top-k path shares: the order-preserving 32-bit keys,
the rank keys, a digit's histogram pass, the select pass and the output.

The k-th best key of each row's [lo, hi), for rows longer than the register path takes
(:mod:`.topk_bisect`), by a radix select over the order-preserving 32-bit key of each logit: the
row is split into segments; ``_topk_hist_kernel`` writes each segment's histogram of the key's top
byte, then (a second launch) of its next byte among the keys whose top byte is the k-th key's;
``_topk_split_kernel`` reads the row's histograms, so knows the k-th key's top 16 bits and how
many entries each earlier segment holds above and at them, and writes its segment's entries above
that bucket as int64 rank keys ``key32 << 32 | (2^32 - 1 - position)`` into the row's scratch and
the bucket's entries into a candidate list (both in position order); ``_topk_kernel`` (one program
per row) finds the last two digits on the candidate list (on the row if the bucket was larger than
the list) and selects the entries above the k-th key and the lowest-position entries equal to it.
The row's program then sorts its k keys (descending: rank order; left out when the caller asks
for no order, ``SORTED`` false) and writes the positions, ``-1`` past the row's candidates, or
(``SLOTS``) the cache slots they map to through the block table.

(``tl.histogram`` costs about log2(bins) warp ballots plus, per bin a lane owns, log2(bins) mask
operations and a popcount per 32 entries: ~2.8 warp instructions per entry at 256 bins, which is
what a histogram level costs on the H200.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.paging import table_slots


@triton.jit
def _key32(x):
    """Signed int32 keys in the ranking order of fp32 ``x``: larger first, ``-0.0 == +0.0``, NaN
    just below ``-inf``."""
    v = x + 0.0  # -0.0 -> +0.0
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(v != v, -2139095042, key)  # (-inf's key) - 1


@triton.jit
def _scalar_positions(start, one, BLOCK: tl.constexpr, THREADS: tl.constexpr):
    """``start + [0, BLOCK)`` as the compiler must load them one entry per instruction (so the
    tensors keep the layout of a scatter by position: entry ``i * THREADS + t`` in thread ``t``):
    the thread's part is multiplied by ``one``, a 1 the compiler cannot see. Returns the positions
    (int32) and the same as int64 sums of a per-thread and a per-entry constant part, so that a
    thread's loads share one address and differ by immediate offsets (an ``xor`` with a hidden 0,
    or int32 positions widened per entry, cost a 64-bit address, two registers, per load: the row
    then loaded in 8 batches, one memory latency each)."""
    i = tl.arange(0, BLOCK // THREADS)[:, None] * THREADS
    t = tl.arange(0, THREADS)[None, :] * one
    pos = tl.reshape(start + i + t, [BLOCK])
    off = tl.reshape((start + t).to(tl.int64) + i.to(tl.int64), [BLOCK])
    return pos, off


@triton.jit
def _row_chunk(
    row_ptr, start, lo, hi, BLOCK: tl.constexpr, SCALAR: tl.constexpr = 0, n_row=0, INSIDE: tl.constexpr = 0,
):  # fmt: skip
    """``(pos, valid, key, ukey)`` of row entries ``[start, start + BLOCK)`` (``valid``: within ``[lo,
    hi)``). ``SCALAR`` (the program's threads): one entry per load instruction, entry ``i * SCALAR +
    t`` in thread ``t``, so the tensors take the layout of a scatter by position (no layout
    conversion before one); its loads are masked by ``pos < n_row`` (the row's storage, ``n_row >=
    hi``; ``valid`` applies ``[lo, hi)`` after the load) except for the first ``INSIDE`` entries a
    thread, which the caller knows lie inside it (``start + INSIDE * SCALAR <= n_row``): those take
    no mask at all. A mask computed from ``valid`` cost a predicate a load that ptxas kept in a
    bit mask, and it then held only 3-8 of a thread's 64 loads in flight (in the SASS); with
    the first half (every row longer than half its power of two) unmasked it holds ~40, then ~35,
    and with the whole row unmasked ~50."""
    if SCALAR:  # (hi >= lo: when not, no entry is valid whatever the positions)
        pos, off = _scalar_positions(start, (hi >= lo).to(tl.int32), BLOCK, SCALAR)
        # (the entry index within the thread as a constant per register: the first INSIDE fold to true)
        ci = tl.reshape(tl.zeros([BLOCK // SCALAR, SCALAR], tl.int32) + tl.arange(0, BLOCK // SCALAR)[:, None], [BLOCK])
        mask = (ci < INSIDE) | (pos < n_row)
    else:
        pos = start + tl.arange(0, BLOCK)
        off = pos
    valid = (pos >= lo) & (pos < hi)
    if not SCALAR:
        mask = valid
    key, ukey = _load_keys(row_ptr, off, mask, INSIDE * SCALAR >= BLOCK)
    return pos, valid, key, ukey


@triton.jit
def _load_keys(row_ptr, off, mask, UNMASKED: tl.constexpr = False):
    """The signed and unsigned 32-bit keys (:func:`_key32`) of ``row_ptr[off]`` where ``mask``
    (those of 0.0 elsewhere; ``UNMASKED``: every ``off`` is inside the row, no mask)."""
    if row_ptr.dtype.element_ty == tl.bfloat16:
        # bf16 -> fp32 as bits (exact; Triton's interpreter, 3.6-3.9, turns bf16 subnormals into
        # other values when it converts them, which reorders the top-k of tiny logits)
        if UNMASKED:
            bits = tl.load(row_ptr.to(tl.pointer_type(tl.int16)) + off)
        else:
            bits = tl.load(row_ptr.to(tl.pointer_type(tl.int16)) + off, mask=mask, other=0)
        x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif UNMASKED:
        x = tl.load(row_ptr + off).to(tl.float32)
    else:
        x = tl.load(row_ptr + off, mask=mask, other=0.0).to(tl.float32)
    key = _key32(x)
    ukey = (key ^ -2147483648).to(tl.uint32, bitcast=True)  # unsigned order
    return key, ukey


@triton.jit
def _digit_hist(hist, valid, ukey, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """``hist`` plus the ``2^BITS``-bin histogram of the digit at ``SHIFT`` of the valid keys whose
    bits above ``SHIFT + BITS`` are ``prefix``."""
    if SHIFT + BITS < 32:
        valid = valid & ((ukey >> (SHIFT + BITS)) == prefix)
    digit = ((ukey >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)
    return hist + tl.histogram(digit, 1 << BITS, mask=valid)


@triton.jit
def _pick_digit(hist, prefix, rem, BITS: tl.constexpr):
    """The digit ``d`` holding the ``rem``-th largest key of ``hist``: ``(prefix << BITS | d, rem -
    count above d, count at d)``."""
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # count with digit >= d
    d = tl.sum((at_or_above >= rem).to(tl.int32), axis=0) - 1
    bins = tl.arange(0, 1 << BITS)
    above = tl.sum(tl.where(bins > d, hist, 0), axis=0)
    at = tl.sum(tl.where(bins == d, hist, 0), axis=0)
    return (prefix << BITS) | d.to(tl.uint32), rem - above, at


@triton.jit
def _rank_keys(key, pos):
    """The select's int64 rank keys: the (signed) key in the high word, ``2^32 - 1 - position`` in
    the low (larger = better; ties by lower position); :func:`_cand_chunk` reads them back."""
    return key.to(tl.int64) * 4294967296 + (4294967295 - pos.to(tl.int64))


@triton.jit
def _unrank(comp):
    """:func:`_rank_keys` undone: ``(pos, key, ukey)`` (int32, signed and unsigned 32-bit keys)."""
    hi32 = comp >> 32
    key = hi32.to(tl.int32)
    pos = (4294967295 - (comp - (hi32 << 32))).to(tl.int32)
    return pos, key, (key ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _cand_chunk(cand, start, n_c, BLOCK: tl.constexpr):
    """Entries ``[start, start + BLOCK)`` of a candidate list of rank keys (``n_c`` long) as
    ``_row_chunk`` gives a row's: ``(pos, valid, key, ukey)``."""
    i = start + tl.arange(0, BLOCK)
    valid = i < n_c
    pos, key, ukey = _unrank(tl.load(cand + i, mask=valid, other=0))
    return pos, valid, key, ukey


@triton.jit
def _chunk(src, start, lo, hi, CAND: tl.constexpr, BLOCK: tl.constexpr):
    """A step of ``BLOCK`` entries of the row (``src`` its logits, ``[lo, hi)``) or of the candidate
    list (``CAND``: ``src`` its rank keys, ``hi`` its length)."""
    if CAND:
        return _cand_chunk(src, start, hi, BLOCK)
    else:
        return _row_chunk(src, start, lo, hi, BLOCK)


@triton.jit
def _radix_pass(
    src, lo, hi, c_lo, prefix, rem, SHIFT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    FOR_LOOP: tl.constexpr, CAND: tl.constexpr = False,
):  # fmt: skip
    """One digit of the select over the row (or the candidate list) in global memory, ``BLOCK``
    entries a step: ``(prefix << BITS | d, rem - count above d, count at d)``."""
    hist = tl.zeros([1 << BITS], tl.int32)
    if FOR_LOOP:
        for start in tl.range(c_lo, hi, BLOCK, num_stages=2):
            _pos, valid, _key, ukey = _chunk(src, start, lo, hi, CAND, BLOCK)
            hist = _digit_hist(hist, valid, ukey, prefix, SHIFT, BITS)
    else:
        start = c_lo
        while start < hi:
            _pos, valid, _key, ukey = _chunk(src, start, lo, hi, CAND, BLOCK)
            hist = _digit_hist(hist, valid, ukey, prefix, SHIFT, BITS)
            start += BLOCK
    return _pick_digit(hist, prefix, rem, BITS)


@triton.jit
def _radix_kth(row_ptr, lo, hi, c_lo, kk, BITS: tl.constexpr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr):
    """The k-th best key of the row by ``32 / BITS`` radix passes over it (:func:`_radix_pass`):
    ``(kth, how many entries equal to it belong to the top kk)``."""
    prefix = tl.zeros([], tl.uint32)
    rem = kk
    for p in tl.static_range(32 // BITS):
        prefix, rem, _at = _radix_pass(row_ptr, lo, hi, c_lo, prefix, rem, 32 - BITS * (p + 1), BITS, BLOCK, FOR_LOOP)
    return prefix, rem


@triton.jit
def _select_pass(
    src, lo, hi, c_lo, kth, need_eq, n_gt, scr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr,
    CAND: tl.constexpr = False,
):  # fmt: skip
    """Every entry above ``kth`` and the first ``need_eq`` equal to it, as rank keys into ``scr``
    from slot ``n_gt`` on."""
    n_gt = n_gt + tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    if FOR_LOOP:
        for start in tl.range(c_lo, hi, BLOCK, num_stages=2):
            pos, valid, key, ukey = _chunk(src, start, lo, hi, CAND, BLOCK)
            n_gt, n_eq = _select_keys(pos, valid, key, ukey, kth, need_eq, n_gt, n_eq, scr)
    else:
        start = c_lo
        while start < hi:
            pos, valid, key, ukey = _chunk(src, start, lo, hi, CAND, BLOCK)
            n_gt, n_eq = _select_keys(pos, valid, key, ukey, kth, need_eq, n_gt, n_eq, scr)
            start += BLOCK
    return n_gt


@triton.jit
def _split_keys(pos, valid, key, ukey, prefix16, n_gt, n_c, scr, cand):
    top = ukey >> 16
    gt = valid & (top > prefix16)
    eq = valid & (top == prefix16)
    comp = _rank_keys(key, pos)
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)  # one scan for both counts (as _select_keys)
    before = tl.cumsum(packed, axis=0) - packed
    tl.store(scr + n_gt + (before & 0xFFFF), comp, mask=gt)
    tl.store(cand + n_c + (before >> 16), comp, mask=eq)
    tot = tl.sum(packed, axis=0)
    return n_gt + (tot & 0xFFFF), n_c + (tot >> 16)


@triton.jit
def _select_keys(pos, valid, key, ukey, kth, need_eq, n_w, n_eq, dst):
    """Write the rank keys of the entries above ``kth`` and of the first ``need_eq`` equal to it
    (``n_eq`` equal ones already seen) to ``dst`` from slot ``n_w`` on; returns the new counts.
    One scan counts both kinds (above: low 16 bits, equal: high; a step holds < 2^16 entries): an
    entry's slot is the entries above before it plus the selected equal ones before it, which are
    ``min(equal before, need_eq)`` less those of earlier steps."""
    gt = valid & (ukey > kth)
    eq = valid & (ukey == kth)
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
    before = tl.cumsum(packed, axis=0) - packed
    eq_before = n_eq + (before >> 16)  # equal entries before this one, all steps
    sel = gt | (eq & (eq_before < need_eq))
    done_eq = tl.minimum(n_eq, need_eq)
    slot = n_w + (before & 0xFFFF) + tl.minimum(eq_before, need_eq) - done_eq
    comp = _rank_keys(key, pos)
    tl.store(dst + slot, comp, mask=sel)
    tot = tl.sum(packed, axis=0)
    n_eq_new = n_eq + (tot >> 16)
    return n_w + (tot & 0xFFFF) + tl.minimum(n_eq_new, need_eq) - done_eq, n_eq_new


@triton.jit
def _row_bounds(lo_ptr, hi_ptr, r, n, k):
    """Row ``r``'s candidate range ``[lo, hi)`` clamped to ``[0, n]``, and ``min(hi - lo, k)``
    (``lo_ptr`` / ``hi_ptr`` None: 0 / ``n``)."""
    if lo_ptr is None:
        lo = tl.zeros([], tl.int32)
    else:
        lo = tl.minimum(tl.maximum(tl.load(lo_ptr + r), 0), n).to(tl.int32)
    if hi_ptr is None:
        hi = tl.maximum(n, lo).to(tl.int32)
    else:
        hi = tl.minimum(tl.maximum(tl.load(hi_ptr + r), lo), n).to(tl.int32)
    return lo, hi, tl.minimum(hi - lo, k)


@triton.jit
def _seg_steps(s, seg_len, lo, hi, BLOCK: tl.constexpr):
    """``[start, end)`` of segment ``s``'s steps of ``BLOCK`` entries within the row's ``[lo, hi)``
    (``start`` a multiple of ``BLOCK``; empty when the segment has none)."""
    seg_lo = s * seg_len
    return tl.maximum(seg_lo, (lo // BLOCK) * BLOCK), tl.minimum(seg_lo + seg_len, hi)


@triton.jit
def _seg_pick(hist, n_seg, s, prefix, rem, S_P2: tl.constexpr, HB: tl.constexpr):
    """The digit of the ``rem``-th largest key from a row's per-segment histograms ``hist [n_seg,
    2^HB]``: ``(prefix << HB | d, rem - count above d, count at d)`` as :func:`_pick_digit`, and the
    counts above ``d`` and at ``d`` in the segments before ``s``."""
    seg = tl.arange(0, S_P2)[:, None]
    h = tl.load(hist + seg * (1 << HB) + tl.arange(0, 1 << HB)[None, :], mask=seg < n_seg, other=0)
    prefix, rem, at = _pick_digit(tl.sum(h, axis=0), prefix, rem, HB)
    d = (prefix & ((1 << HB) - 1)).to(tl.int32)
    before = tl.sum(tl.where(seg < s, h, 0), axis=0)
    bins = tl.arange(0, 1 << HB)
    gt_before = tl.sum(tl.where(bins > d, before, 0), axis=0)
    eq_before = tl.sum(tl.where(bins == d, before, 0), axis=0)
    return prefix, rem, at, gt_before, eq_before


@triton.jit
def _levels_pick(hrow, n_seg, s, kk, LEVELS: tl.constexpr, S_P2: tl.constexpr, HB: tl.constexpr):
    """The first ``LEVELS`` digits (``HB`` bits each) of row's k-th best key from its histogram
    levels: ``(prefix, rem, count at prefix, count above prefix in segments before s, count at
    prefix in segments before s)``."""
    prefix = tl.zeros([], tl.uint32)
    rem = kk
    at = kk
    gt = tl.zeros([], tl.int32)
    eq = tl.zeros([], tl.int32)
    for lv in tl.static_range(LEVELS):
        prefix, rem, at, gt_lv, eq = _seg_pick(hrow + lv * n_seg * (1 << HB), n_seg, s, prefix, rem, S_P2, HB)
        gt += gt_lv
    return prefix, rem, at, gt, eq


@triton.jit
def _topk_hist_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, hist_ptr, stride_hr, n, k, n_seg, seg_len,
    LEVEL: tl.constexpr, HB: tl.constexpr, S_P2: tl.constexpr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    """Grid ``(rows, n_seg)``: ``hist[r, LEVEL, s]`` = the ``2^HB``-bin histogram, over segment
    ``s`` (``seg_len`` entries) of row ``r``'s candidates, of key digit ``LEVEL`` (``HB`` bits from
    the top) among the keys whose higher digits are the k-th best key's (from the row's histograms
    at the lower levels)."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    hrow = hist_ptr + r.to(tl.int64) * stride_hr
    prefix, _rem, _at, _gt, _eq = _levels_pick(hrow, n_seg, s, tl.maximum(kk, 1), LEVEL, S_P2, HB)
    hist = tl.zeros([1 << HB], tl.int32)
    start0, end = _seg_steps(s, seg_len, lo, hi, BLOCK)
    if FOR_LOOP:
        for start in tl.range(start0, end, BLOCK, num_stages=2):
            _pos, valid, _key, ukey = _row_chunk(row_ptr, start, lo, hi, BLOCK)
            hist = _digit_hist(hist, valid, ukey, prefix, 32 - HB * (LEVEL + 1), HB)
    else:
        start = start0
        while start < end:
            _pos, valid, _key, ukey = _row_chunk(row_ptr, start, lo, hi, BLOCK)
            hist = _digit_hist(hist, valid, ukey, prefix, 32 - HB * (LEVEL + 1), HB)
            start += BLOCK
    tl.store(hrow + (LEVEL * n_seg + s) * (1 << HB) + tl.arange(0, 1 << HB), hist)


@triton.jit
def _topk_split_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, hist_ptr, stride_hr, scr_ptr, stride_sr, cand_ptr, stride_cr,
    n, k, n_seg, seg_len, cap, HB: tl.constexpr, S_P2: tl.constexpr, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    """Grid ``(rows, n_seg)``: from the histogram levels, the k-th best key's top 16 bits ``p16``;
    when the row holds at most ``cap`` entries with those bits, segment ``s`` writes its entries
    above ``p16`` as rank keys into ``scr[r]`` and those at ``p16`` into ``cand[r]``, each after
    the earlier segments' (so both lists are in position order)."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    hrow = hist_ptr + r.to(tl.int64) * stride_hr
    if kk > 0:
        p16, _rem, at, n_gt, n_c = _levels_pick(hrow, n_seg, s, kk, 16 // HB, S_P2, HB)
        if at <= cap:
            scr = scr_ptr + r.to(tl.int64) * stride_sr
            cand = cand_ptr + r.to(tl.int64) * stride_cr
            start0, end = _seg_steps(s, seg_len, lo, hi, BLOCK)
            if FOR_LOOP:
                for start in tl.range(start0, end, BLOCK, num_stages=2):
                    pos, valid, key, ukey = _row_chunk(row_ptr, start, lo, hi, BLOCK)
                    n_gt, n_c = _split_keys(pos, valid, key, ukey, p16, n_gt, n_c, scr, cand)
            else:
                start = start0
                while start < end:
                    pos, valid, key, ukey = _row_chunk(row_ptr, start, lo, hi, BLOCK)
                    n_gt, n_c = _split_keys(pos, valid, key, ukey, p16, n_gt, n_c, scr, cand)
                    start += BLOCK


@triton.jit
def _topk_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, scr_ptr, stride_sr, out_ptr, stride_or, n, k, table,
    cand_ptr, stride_cr, cap, hist_ptr, stride_hr, n_seg,
    BLOCK: tl.constexpr, K_P2: tl.constexpr, SLOTS: tl.constexpr, FOR_LOOP: tl.constexpr, S_P2: tl.constexpr,
    HB: tl.constexpr, SORTED: tl.constexpr,
):  # fmt: skip
    """Grid ``(rows,)``: ``out[r, :min(k, K_P2)]`` = row ``r``'s best positions in rank order
    (without ``SORTED``: in the order the select wrote them, the final sort left out; ``-1`` past
    its ``min(k, hi - lo)`` candidates either way), or with ``SLOTS`` their cache slots through
    ``block_table[r // next_n]`` (``-1`` where a position has none; ``table``: ``(bt_ptr,
    stride_bt, n_log, pbs, next_n)``). ``scr[r, :K_P2]``: scratch. After :func:`_topk_hist_kernel`
    at its ``16 / HB`` levels and :func:`_topk_split_kernel`: the k-th key's top 16 bits come from
    the row's histograms; when its bucket fit in ``cap``, the last two 8-bit digits and the select
    read only the candidate list ``cand[r, :cap]`` (the entries above the bucket are already in
    ``scr``), else the row."""
    tl.static_assert(BLOCK <= 16384, "the select packs two counts of a step into one int32 (the high one < 2^15)")
    bt_ptr, stride_bt, n_log, pbs, next_n = table
    r = tl.program_id(0)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    lo, hi, kk = _row_bounds(lo_ptr, hi_ptr, r, n, k)
    scr = scr_ptr + r.to(tl.int64) * stride_sr
    if kk > 0:
        c_lo = (lo // BLOCK) * BLOCK
        hrow = hist_ptr + r.to(tl.int64) * stride_hr
        prefix, rem, at, _gt, _eq = _levels_pick(hrow, n_seg, 0, kk, 16 // HB, S_P2, HB)
        if at <= cap:  # kk - rem entries above the bucket are in scr; the bucket's `at` in cand
            cand = cand_ptr + r.to(tl.int64) * stride_cr
            n_gt = kk - rem
            prefix, rem, _at = _radix_pass(cand, 0, at, 0, prefix, rem, 8, 8, BLOCK, FOR_LOOP, True)
            prefix, rem, _at = _radix_pass(cand, 0, at, 0, prefix, rem, 0, 8, BLOCK, FOR_LOOP, True)
            _select_pass(cand, 0, at, 0, prefix, rem, n_gt, scr, BLOCK, FOR_LOOP, True)
        else:
            prefix, rem, _at = _radix_pass(row_ptr, lo, hi, c_lo, prefix, rem, 8, 8, BLOCK, FOR_LOOP)
            prefix, rem, _at = _radix_pass(row_ptr, lo, hi, c_lo, prefix, rem, 0, 8, BLOCK, FOR_LOOP)
            _select_pass(row_ptr, lo, hi, c_lo, prefix, rem, 0, scr, BLOCK, FOR_LOOP)
    _emit_topk(scr, r, kk, k, out_ptr, stride_or, bt_ptr, stride_bt, n_log, pbs, next_n, K_P2, SLOTS, SORTED)


@triton.jit
def _emit_topk(
    scr, r, kk, k, out_ptr, stride_or, bt_ptr, stride_bt, n_log, pbs, next_n,
    K_P2: tl.constexpr, SLOTS: tl.constexpr, SORTED: tl.constexpr,
):  # fmt: skip
    """Row ``r``'s ``kk`` selected rank keys (``scr[:kk]``) written out: in rank order (``SORTED``)
    or as selected, as positions or (``SLOTS``) cache slots, ``-1`` after them up to ``K_P2``."""
    tl.debug_barrier()  # every thread's scratch stores before any thread's loads
    rank = tl.arange(0, K_P2)
    top = tl.load(scr + rank, mask=rank < kk, other=-9223372036854775808)
    if SORTED:
        top = tl.sort(top, descending=True)
    low = top - ((top >> 32) << 32)  # 2^32 - 1 - position
    res = tl.where(rank < kk, 4294967295 - low, -1)
    if SLOTS:  # block_table[r // next_n, t // pbs] * pbs + t % pbs; -1 where there is none
        res = table_slots(res, bt_ptr + (r // next_n).to(tl.int64) * stride_bt, 1, n_log, pbs, rank < k)
    tl.store(out_ptr + r.to(tl.int64) * stride_or + rank, res.to(tl.int32), mask=rank < k)
