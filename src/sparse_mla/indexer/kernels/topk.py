"""The indexer's top-k: :func:`launch_topk` and its configuration. Each row's ``min(k, hi - lo)``
best positions (or their cache slots) by one of three paths, chosen by the row length: the register
path (a row in one program's registers, :mod:`.topk_bisect`), the split path (longer rows up to
32K: a sample's threshold, the candidates gathered by many programs, a list per row, also in
:mod:`.topk_bisect`), or the radix select (longer rows: histograms, a split into a candidate list,
a per-row finish, :mod:`.topk_radix`). Twin: :func:`sparse_mla.indexer.reference.topk_indices_reference`."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ...core.checks import check_apart, check_no_self_overlap
from ...core.env import cdiv, interpreting, next_pow2, require_runnable
from ...core.launcher import launch as launch_kernel
from ...core.paging import table_slots
from ...core.target import device_target, pdl_enabled
from ..problem import check_tensor_arg
from .common import resolve_config, sm_count, split_work
from .topk_bisect import (
    _bisect_down,
    _bisect_down16,
    _bisect_packed,
    _column_slots,
    _f16x2_add,
    _f16x2_ge,
    _f16x2_lanes,
    _finish_from_list,
    _finish_keys,
    _list_or_select,
    _max_pair,
    _pair_lanes,
    _topk_bisect_kernel,
    _topk_list_kernel,
    _topk_split_pos_kernel,
    _topk_threshold_kernel,
)
from .topk_radix import (
    _cand_chunk,
    _chunk,
    _digit_hist,
    _emit_topk,
    _key32,
    _levels_pick,
    _load_keys,
    _pick_digit,
    _radix_kth,
    _radix_pass,
    _rank_keys,
    _row_bounds,
    _row_chunk,
    _scalar_positions,
    _seg_pick,
    _seg_steps,
    _select_keys,
    _select_pass,
    _split_keys,
    _topk_hist_kernel,
    _topk_kernel,
    _topk_split_kernel,
    _unrank,
)

__all__ = ["TopkConfig", "TOPK_CONFIG", "launch_topk", "topk_config", "launch_topk_split"]

HIST_BITS = 8  # bits per histogram level of the radix select (16 / HIST_BITS levels, 2^HIST_BITS bins)
MAX_SEGMENTS = 16  # a row's per-segment histograms are summed as one [16, 256] tile

_POW2 = {  # (block, split_block: the select packs two counts of a step into one int32)
    "block": (32, 16384),
    "split_block": (32, 16384),
    "num_warps": (1, 32),
    "bisect_cap": (1, 64),
    "bisect_warps": (1, 32),
    "split_chunk": (32, 32768),
    "split_warps": (1, 32),
    "split_cap": (1, 64),
    "split_list_warps": (1, 32),
    "split_sample": (1, 4096),
    "split_sample_warps": (1, 32),
}


@dataclass(frozen=True)
class TopkConfig:
    """Launch parameters of the top-k (checked when made: ``ValueError`` naming the field).

    The register path: rows of at most ``bisect`` entries (rounded up to a power of two; 0: never)
    take :func:`~.topk_bisect._topk_bisect_kernel` (the row in one program's registers), with up to
    ``bisect_warps`` warps (fewer for short rows: one per 2048 entries, at least 4) and a list of up
    to ``bisect_cap`` x k keys (both powers of two).

    The split path: rows of at least ``split`` entries (and within ``bisect``; 0: never), with
    ``split_chunk`` entries per program of the positions kernel (``split_warps`` warps), a list of
    up to ``split_cap`` x k entries (``split_list_warps`` warps), a sample of ``split_sample``
    entries (``split_sample_warps`` warps). H200, 256 rows, k 2048, unsorted, graph: 38.4 / 37.7 /
    38.2 µs at 8192 / 12288 / 16384 entries against the register path's 38.9 / 47.6 / 44.4 (shorter
    rows not measured); at 32768 entries 42.5 µs against 53.9, rank order 78.4 / 91.4; the flagged
    rows finished inside the list kernel (no fourth launch): unsorted 42.0 -> 40.7-41.3 µs, rank
    order 78.3 -> 76.5, 16384 entries 38.0 -> 36.3.

    Longer rows take the radix select: ``block`` row entries a step, ``num_warps``; ``compact``:
    the candidate list's capacity per row; ``programs_per_sm``: the row split of the histogram and
    split kernels (about this many programs per SM, at most 16 segments a row); ``split_block``:
    the split kernel's step; ``final_warps``: the per-row kernel's warps (0: ``num_warps``). H200
    (256 x 32K, k 2048, kernel time): these defaults 223 µs; 8 programs per SM 226; a 4-warp
    per-row kernel 231-234.
    """

    block: int = 2048
    num_warps: int = 4
    compact: int = 2048
    programs_per_sm: int = 4
    split_block: int = 2048
    final_warps: int = 8
    bisect: int = 32768
    bisect_warps: int = 16
    bisect_cap: int = 2
    split: int = 8192
    split_chunk: int = 4096
    split_warps: int = 8
    split_cap: int = 2
    split_list_warps: int = 16
    split_sample: int = 2048
    split_sample_warps: int = 4

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"config: {f.name} must be an int, got {v!r}")
        for key, (lo, hi) in _POW2.items():
            v = getattr(self, key)
            if not lo <= v <= hi or v & (v - 1):
                raise ValueError(f"config: {key} must be a power of two from {lo} to {hi}, got {v!r}")
        checks = (
            ("compact", self.compact >= 1, "must be >= 1"),
            ("programs_per_sm", 1 <= self.programs_per_sm <= 64, "must be from 1 to 64"),
            ("final_warps", self.final_warps in (0, 1, 2, 4, 8, 16, 32), "must be 0 (num_warps) or a power of two up to 32"),
            ("bisect", 0 <= self.bisect <= 32768, "must be from 0 (never) to 32768"),
            ("split", self.split >= 0, "must be >= 0 (0 = never)"),
        )  # fmt: skip
        for key, ok, what in checks:
            if not ok:
                raise ValueError(f"config: {key} {what}, got {getattr(self, key)!r}")


#: the default (``benchmarks/indexer_sweep.py`` times others, passed as ``config``)
TOPK_CONFIG = TopkConfig()


def topk_config(config: object) -> TopkConfig:
    """``config`` (a :class:`TopkConfig`, a dict of its fields to change, or None) as a :class:`TopkConfig`."""
    return resolve_config(config, TOPK_CONFIG)


def _check_topk_launch(logits, lo, hi, out, k, kk, table, page_block_size, next_n) -> None:
    """``launch_topk``'s tensors and sizes as its docstring states them (``ValueError``/``TypeError``
    naming the argument): what the kernels read and write must lie inside them."""
    check_tensor_arg(logits, "logits", (torch.float32, torch.float16, torch.bfloat16), 2)
    rows, n = logits.shape
    if logits.stride(1) != 1 and n > 1:
        raise ValueError(f"logits: entries must be contiguous (stride(1) == 1), got strides {tuple(logits.stride())}")
    for name, v, lo_v in (("k", k, 1), ("kk", kk, 1), ("next_n", next_n, 1), ("page_block_size", page_block_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo_v:
            raise ValueError(f"{name}: expected an int >= {lo_v}, got {v!r}")
    if kk != min(k, n):  # (n == 0 has nothing to select: the caller fills out with -1)
        raise ValueError(f"kk: expected min(k, n) = {min(k, n)}, got {kk}")
    check_tensor_arg(out, "out", (torch.int32,), 2)
    if tuple(out.shape) != (rows, k) or (k > 1 and out.stride(1) != 1) or out.device != logits.device:
        raise ValueError(f"out: expected [{rows}, {k}] int32 with contiguous entries on {logits.device}, got "
                         f"{list(out.shape)} strides {tuple(out.stride())} on {out.device}")  # fmt: skip
    for name, t in (("lo", lo), ("hi", hi)):
        if t is not None:
            check_tensor_arg(t, name, (torch.int32, torch.int64), 1)
            if t.shape[0] != rows or (rows > 1 and t.stride(0) != 1) or t.device != logits.device:
                raise ValueError(
                    f"{name}: expected [{rows}] contiguous on {logits.device}, got {list(t.shape)} on {t.device}"
                )
    if table is not None:
        check_tensor_arg(table, "table", (torch.int32, torch.int64), 2)
        if rows % next_n or table.shape[0] != rows // next_n or (table.shape[1] > 1 and table.stride(1) != 1):
            raise ValueError(f"table: expected [rows / next_n = {rows / next_n}, max_blocks] with contiguous "
                             f"entries, got {list(table.shape)} strides {tuple(table.stride())}")  # fmt: skip
        if table.device != logits.device:
            raise ValueError(f"table: expected on {logits.device}, got {table.device}")
    check_no_self_overlap(out, "out")
    check_apart(out, "out", (logits, lo, hi, table))


def launch_topk_split(logits, lo, hi, out, scratch, k, k_p2, n_p2, bt, slots, page_block_size, next_n, ordered, cfg):
    """The split path's three launches (:func:`_topk_threshold_kernel`, :func:`_topk_split_pos_kernel`,
    :func:`_topk_list_kernel`, which also does the rows it flags); returns the rows' flags ``[rows]``
    int32 (1: the sample misjudged the row; for tests and benchmarks)."""
    rows, n = logits.shape
    sw, lw = 32 * cfg.split_warps, 32 * cfg.split_list_warps
    chunk = max(min(cfg.split_chunk, n_p2), sw)
    nch = cdiv(n, chunk)
    cap = max(min(n_p2, k_p2 * cfg.split_cap), lw)  # (powers of two: a multiple of lw)
    sample = min(cfg.split_sample, cap)
    groups = min(64, sample)
    rk = torch.empty((rows, nch * chunk), dtype=torch.int64, device=logits.device)  # (written sparsely)
    ws = torch.empty(rows * (nch + 2), dtype=torch.int32, device=logits.device)
    cnt = ws[: rows * nch].view(rows, nch)
    thr, flags = ws[rows * nch :].view(2, rows)
    pdl = pdl_enabled(logits.device)
    dep = {"launch_pdl": True} if pdl else {}
    table = (bt, bt.stride(0) if slots else 0, bt.shape[1] if slots else 0, page_block_size, next_n)
    launch_kernel(
        _topk_threshold_kernel, (rows, 1, 1), (logits, logits.stride(0), lo, hi, thr, n, k),
        dict(CAP=cap, SAMPLE_G=groups, SAMPLE_L=sample // groups, END=20, PDL=pdl), {"num_warps": cfg.split_sample_warps},
    )  # fmt: skip
    launch_kernel(
        _topk_split_pos_kernel, (rows, nch, 1),
        (logits, logits.stride(0), lo, hi, thr, rk, rk.stride(0), cnt, cnt.stride(0), n),
        dict(CHUNK=chunk, THREADS=sw, PDL=pdl), {"num_warps": cfg.split_warps, **dep},
    )  # fmt: skip
    launch_kernel(
        _topk_list_kernel, (rows, 1, 1),
        (logits, logits.stride(0), lo, hi, rk, rk.stride(0), cnt, cnt.stride(0), flags, scratch, scratch.stride(0),
         out, out.stride(0), n, k, table),
        dict(NCH=nch, CHUNK=chunk, CAP=cap, THREADS=lw, TIE_BITS=n_p2.bit_length() - 1, N_P2=n_p2, K_P2=k_p2,
             SLOTS=slots, SORTED=bool(ordered), PDL=pdl, BLOCK=min(cfg.block, 1024), FOR_LOOP=not interpreting()),
        {"num_warps": cfg.split_list_warps, **dep},
    )  # fmt: skip
    return flags


def launch_topk(
    logits, lo, hi, out, k, kk, table=None, page_block_size=1, next_n=1, config=None, ordered=True, *, _checked=False
) -> None:
    """``logits [rows, n]`` (row stride any, entries contiguous), ``lo``/``hi`` ``[rows]`` int32 or
    int64 (clamped to ``[0, n]`` here) or None (every row from 0 / to ``n``: no tensors to fill),
    ``out [rows, k]`` int32 (entries contiguous): each row's ``min(k, hi - lo)`` best positions in
    rank order (``ordered``; else in no set order) and ``-1`` after them, in columns
    ``< next_power_of_2(kk)`` (``kk = min(k, n)``; the caller fills any column past that). With
    ``table`` (``[b, max_blocks]`` int32/int64, entries contiguous, ``b = rows / next_n``) the
    positions become cache slots as :func:`sparse_mla.kvcache.reference.abs_indices_to_kvcache_indices`
    maps them. ``config``: a :class:`TopkConfig`, a dict of its fields to change, or None
    (:data:`TOPK_CONFIG`). ``_checked``: the caller (:func:`sparse_mla.indexer.topk._topk`) has
    checked the tensors and made ``out`` and ``kk`` itself, so they are not checked again (~12 µs
    of host time a call)."""
    cfg = topk_config(config)
    if not _checked:
        _check_topk_launch(logits, lo, hi, out, k, kk, table, page_block_size, next_n)
    require_runnable(
        _topk_kernel, logits.device, _key32, _row_chunk, _cand_chunk, _chunk, _digit_hist, _pick_digit,
        _radix_pass, _radix_kth, _select_pass, _split_keys, _select_keys, table_slots, _row_bounds, _seg_steps, _seg_pick, _levels_pick,
        _topk_hist_kernel, _topk_split_kernel, _emit_topk, _topk_bisect_kernel, _bisect_down, _column_slots, _rank_keys,
        _scalar_positions, _bisect_down16, _f16x2_ge, _f16x2_add, _f16x2_lanes, _pair_lanes, _bisect_packed,
        _finish_from_list, _list_or_select, _load_keys, _finish_keys, _topk_threshold_kernel, _topk_split_pos_kernel,
        _topk_list_kernel, _max_pair, _unrank,
    )  # fmt: skip
    rows, n = logits.shape
    if rows == 0:
        return
    if n == 1 and (lo is None or hi is None):  # (Triton compiles n == 1 as a constant; a row of constant
        # bounds then fails its coalesce pass, so such rows get range tensors)
        z = torch.zeros(rows, dtype=torch.int32, device=logits.device)
        lo, hi = (z if lo is None else lo), (z + 1 if hi is None else hi)
    k_p2 = next_pow2(kk)
    block = min(cfg.block, max(next_pow2(n), 256))
    slots = table is not None
    bt = table if slots else out  # (a placeholder when there is no table: never read)
    table_args = (bt, bt.stride(0) if slots else 0, bt.shape[1] if slots else 0, page_block_size, next_n)
    for_loop = not interpreting()
    n_p2 = next_pow2(n)
    if n_p2 <= cfg.bisect:  # the row fits in one program's registers
        warps = min(cfg.bisect_warps, max(4, n_p2 // 2048))
        n_p2 = max(n_p2, 32 * warps)  # every thread holds an entry
        if cfg.split and n >= cfg.split:  # the split path (its list kernel also does the rows it flags)
            scratch = torch.empty((rows, k_p2), dtype=torch.int64, device=logits.device)
            launch_topk_split(logits, lo, hi, out, scratch, k, k_p2, n_p2, bt, slots, page_block_size, next_n,
                               ordered, cfg)  # fmt: skip
            return
        cap = min(n_p2, max(k_p2 * cfg.bisect_cap, k_p2, 32 * warps))
        ws = torch.empty((rows, k_p2 + cap), dtype=torch.int64, device=logits.device)
        scratch, cand = ws[:, :k_p2], ws[:, k_p2:]
        # (through the direct launcher, as the split path's three launches: each ~20-30 µs of host
        # time through Triton's own path)
        launch_kernel(
            _topk_bisect_kernel, (rows, 1, 1),
            (logits, logits.stride(0), lo, hi, scratch, scratch.stride(0), out, out.stride(0), n, k, table_args,
             cand, cand.stride(0)),
            dict(N_P2=n_p2, BLOCK=block, K_P2=k_p2, CAP=cap, THREADS=32 * warps, TIE_BITS=n_p2.bit_length() - 1,
                 SLOTS=slots, SORTED=bool(ordered), FOR_LOOP=for_loop, PACK16=n_p2 >= 64 * warps,
                 ASM=for_loop and device_target(logits.device).vendor == "nvidia",
                 INSIDE=(n_p2 if n == n_p2 else n_p2 // 2 if 2 * n > n_p2 else 0) // (32 * warps)),
            {"num_warps": warps},
        )  # fmt: skip
        return
    hb, cap = HIST_BITS, cfg.compact
    # segments of `per` steps: about programs_per_sm programs per SM, at most MAX_SEGMENTS a row
    n_blk = cdiv(n, block)
    per, n_seg = split_work(n_blk, rows, cfg.programs_per_sm * sm_count(logits.device))
    if n_seg > MAX_SEGMENTS:
        per = cdiv(n_blk, MAX_SEGMENTS)
        n_seg = cdiv(n_blk, per)
    s_p2 = next_pow2(n_seg)
    n_hist = rows * (16 // hb) * n_seg * (1 << hb)
    # one allocation: scratch [rows, k_p2] int64, candidate lists [rows, cap] int64, histograms int32
    ws = torch.empty(rows * (k_p2 + cap) + n_hist // 2, dtype=torch.int64, device=logits.device)
    scratch = ws[: rows * k_p2].view(rows, k_p2)
    cand = ws[rows * k_p2 : rows * (k_p2 + cap)].view(rows, cap)
    hist = ws[rows * (k_p2 + cap) :].view(torch.int32).view(rows, 16 // hb, n_seg, 1 << hb)
    # the histogram levels and the split, each over (rows, segments) programs, then one program a row
    meta = dict(HB=hb, S_P2=s_p2, FOR_LOOP=for_loop, num_warps=cfg.num_warps)
    args = (logits, logits.stride(0), lo, hi, hist, hist.stride(0))
    for level in range(16 // hb):
        _topk_hist_kernel[(rows, n_seg)](*args, n, k, n_seg, per * block, LEVEL=level, BLOCK=block, **meta)
    split_block = min(cfg.split_block, block)
    _topk_split_kernel[(rows, n_seg)](
        *args, scratch, scratch.stride(0), cand, cand.stride(0), n, k, n_seg, per * block, cap,
        BLOCK=split_block, **meta,
    )  # fmt: skip
    _topk_kernel[(rows,)](
        logits, logits.stride(0), lo, hi, scratch, scratch.stride(0), out, out.stride(0), n, k, table_args,
        cand, cand.stride(0), cap, hist, hist.stride(0), n_seg,
        BLOCK=block, K_P2=k_p2, SLOTS=slots, FOR_LOOP=for_loop, S_P2=s_p2, HB=hb, SORTED=bool(ordered),
        num_warps=cfg.final_warps or cfg.num_warps,
    )  # fmt: skip
