"""Loading cache records inside a Triton kernel: a block of indexed tokens gathered from the FP8
paged cache (V32 or MODEL1) and dequantised to dot operands, and the host-side arguments and
constexprs that describe a cache to it. Imports Triton: only kernel modules import it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.fp8 import e4m3_decode_exact
from ..core.target import Target
from .layouts import cache_bytes

__all__ = [
    "ADDR_CONTIGUOUS_V32",
    "ADDR_POW2_PAGE",
    "ADDR_GENERAL",
    "e4m3_to",
    "load_block_keys",
    "SLOTS_INDICES",
    "SLOTS_BLOCK_TABLE",
    "SLOTS_BLOCK_TABLE_WIDE",
    "block_table_slots",
    "paged_block_offset",
    "paged_positions",
    "load_paged_rows",
    "cache_args",
    "row_cache_args",
    "gather_consts",
    "dot_consts",
]


# how a token's cache address is computed (constexpr ADDR)
ADDR_CONTIGUOUS_V32 = tl.constexpr(0)  # V32 cache whose blocks are contiguous: token address = slot * token_stride


ADDR_POW2_PAGE = tl.constexpr(1)  # power-of-two page_block_size: shift and mask


ADDR_GENERAL = tl.constexpr(2)  # integer division


# where a block's cache slots come from (constexpr SLOTS of load_block_keys)
SLOTS_INDICES = tl.constexpr(0)  # an indices tensor: sel = (ptr, stride_b, stride_s, stride_t, topk, len_ptr)


# positions pos0.. of request `req` through its block-table row (the dense decode):
# sel = (block_table_ptr, stride_b, causal_back, stride_col, max_blocks * pbs, len_ptr), see paged_positions
SLOTS_BLOCK_TABLE = tl.constexpr(1)
# the same where page_block_size >= 64 (every BLOCK_N): a step's positions lie in one block or two
# consecutive ones, found without a division per position
SLOTS_BLOCK_TABLE_WIDE = tl.constexpr(2)


def block_table_slots(page_block_size: int) -> int:
    """The ``SLOTS`` value of a dense decode over pages of ``page_block_size`` tokens."""
    return (SLOTS_BLOCK_TABLE_WIDE if page_block_size >= 64 else SLOTS_BLOCK_TABLE).value


@triton.jit
def e4m3_to(k8, DOT_DTYPE: tl.constexpr, FP8_HW: tl.constexpr):
    """Cache bytes (OCP e4m3) -> dot operands: by the hardware's e4m3 conversion where the target
    has one (``FP8_HW``, :attr:`sparse_mla.core.target.Target.fp8_convert`), else by the exact
    integer decode: sm_80/86, every AMD target (gfx942's FP8 hardware reads FNUZ; Triton's AMD
    cast can read the NaN bytes as +-480) and the interpreter, whose e4m3 cast reads them so too.
    The same values."""
    if FP8_HW:
        return k8.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
    else:
        return e4m3_decode_exact(k8).to(DOT_DTYPE)


@triton.jit
def load_block_keys(
    cache,
    sel,
    req,
    sq,
    pos0,
    n_valid,
    ADDR: tl.constexpr,
    IS_V32: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_NOPE: tl.constexpr,
    D_TAIL: tl.constexpr,
    TILE: tl.constexpr,
    MAIN_TILES: tl.constexpr,
    NUM_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FP8_HW: tl.constexpr,
    SLOTS: tl.constexpr = SLOTS_INDICES,
):
    """Gather and dequantise BLOCK_N indexed tokens: (k_main [N, 512], k_tail [N, 64], valid [N]).
    ``SLOTS_BLOCK_TABLE`` / ``SLOTS_BLOCK_TABLE_WIDE``: the tokens at positions ``pos0 ..`` of request
    ``req`` (the dense decode)."""
    kv_ptr, stride_blk, stride_tok, num_tokens, pbs, pbs_log2 = cache
    idx_ptr, stride_ib, stride_is, stride_it, _topk, _len_ptr = sel
    offs_n = pos0 + tl.arange(0, BLOCK_N)
    in_list = offs_n < n_valid
    if SLOTS != SLOTS_INDICES:
        idx, in_list = paged_positions(sel, req, sq, pos0, n_valid, pbs, BLOCK_N, SLOTS == SLOTS_BLOCK_TABLE_WIDE)
    else:
        # offsets in int64 (a view's strides can take them past 2^31); req and sq may be ints
        row = tl.zeros([], tl.int64) + req
        col = tl.zeros([], tl.int64) + sq
        idx = tl.load(
            idx_ptr + row * stride_ib + col * stride_is + offs_n.to(tl.int64) * stride_it, mask=in_list, other=-1
        )
    valid = in_list & (idx >= 0) & (idx < num_tokens)
    safe = tl.where(valid, idx, 0).to(tl.int64)
    if ADDR == ADDR_CONTIGUOUS_V32:
        blk = safe * 0
        off = safe
    elif ADDR == ADDR_POW2_PAGE:
        blk = safe >> pbs_log2
        off = safe & (pbs - 1)
    else:
        blk = safe // pbs
        off = safe - blk * pbs
    cols = tl.arange(0, D_MAIN)
    if IS_V32:
        tok = blk * stride_blk + off * stride_tok  # byte offset of each token record
        k8 = tl.load(kv_ptr + tok[:, None] + cols[None, :], mask=valid[:, None], other=0)
        kf = e4m3_to(k8, DOT_DTYPE, FP8_HW)
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
        kf = e4m3_to(k8, DOT_DTYPE, FP8_HW)
        tiles = tl.arange(0, MAIN_TILES)
        eb = tl.load(
            kv_ptr + base[:, None] + pbs * (D_NOPE + 2 * D_TAIL) + off[:, None] * 8 + tiles[None, :],
            mask=valid[:, None] & (tiles[None, :] < NUM_TILES),
            other=127,
        )
        sc = tl.exp2(eb.to(tl.float32) - 127.0).to(DOT_DTYPE)
        kf = tl.reshape(tl.reshape(kf, [BLOCK_N, MAIN_TILES, TILE]) * sc[:, :, None], [BLOCK_N, D_MAIN])
        rptr = (kv_ptr + tok + D_NOPE).to(tl.pointer_type(tl.bfloat16))
        rc = cols - D_NOPE
        rope = tl.load(rptr[:, None] + rc[None, :], mask=valid[:, None] & (cols[None, :] >= D_NOPE), other=0.0)
        kf = tl.where(is_nope[None, :], kf, rope.to(DOT_DTYPE))
        k_tail = tl.zeros([BLOCK_N, D_TAIL], dtype=tl.bfloat16)
    return kf.to(DOT_DTYPE), k_tail.to(DOT_DTYPE), valid


@triton.jit
def paged_block_offset(sel, req, sq, pos0, n_valid, pbs, BLOCK_N: tl.constexpr, WIDE: tl.constexpr):
    """Where positions ``pos0 .. pos0 + BLOCK_N - 1`` of request ``req`` lie for query token ``sq``, through the
    block table ``sel = (table_ptr, stride_b, causal_back, stride_col, max_blocks * pbs, len_ptr)``:
    ``(block int64, offset int32, ok, counted)``. ``counted``: the position is attended (below
    ``n_valid - (causal_back - sq)``, ``n_valid`` the request's length, ``causal_back = s_q - 1``
    with causal, else 0); ``ok``: also its block lies inside the row, the entry is not negative and
    the slot ``block * pbs + offset`` is below 2^31. Integer division is a long software sequence
    on GPUs, and a [BLOCK_N] vector's is repeated in every thread that holds a row: ``WIDE``
    (``pbs >= BLOCK_N``) divides ``pos0`` once (the positions then lie in one block or the next),
    else each position is divided in int32 (positions and page sizes are below 2^31; a position that
    wrapped past it is negative and not ``ok``)."""
    bt_ptr, stride_bb, back, stride_bc, positions, _len_ptr = sel
    offs = tl.arange(0, BLOCK_N)
    pos = pos0.to(tl.int32) + offs
    counted = pos < n_valid - tl.maximum(back - sq, 0)
    if WIDE:
        lb0 = pos0.to(tl.int32) // pbs
        off = pos0.to(tl.int32) - lb0 * pbs + offs
        nxt = off >= pbs
        lb = lb0 + nxt.to(tl.int32)
        off = tl.where(nxt, off - pbs, off)
    else:
        lb = tl.where(pos >= 0, pos, 0) // pbs
        off = pos - lb * pbs
    ok = counted & (pos >= 0) & (lb < positions // pbs)
    row = bt_ptr + req.to(tl.int64) * stride_bb
    phys = tl.load(row + lb.to(tl.int64) * stride_bc, mask=ok, other=-1).to(tl.int64)
    ok = ok & (phys >= 0) & (phys * pbs + off <= 2147483647)
    return phys, off, ok, counted


@triton.jit
def paged_positions(sel, req, sq, pos0, n_valid, pbs, BLOCK_N: tl.constexpr, WIDE: tl.constexpr):
    """The cache slots of positions ``pos0 ..`` (BLOCK_N of them) of request ``req`` for query token
    ``sq`` through the block table (:func:`paged_block_offset`): ``(slots int64, counted)``, a slot
    -1 where the position is not attended or its entry is outside the table's contract."""
    phys, off, ok, counted = paged_block_offset(sel, req, sq, pos0, n_valid, pbs, BLOCK_N, WIDE)
    return tl.where(ok, phys * pbs + off, -1), counted


@triton.jit
def load_paged_rows(
    kv,
    sel,
    req,
    sq,
    pos0,
    n_valid,
    IS_V32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Gather BLOCK_N tokens of a bf16/fp16 paged cache ``[num_blocks, pbs, 1, d_qk]`` at positions
    ``pos0 ..`` of request ``req`` through its block table (:func:`paged_block_offset`):
    ``(k_main [N, 512], k_tail [N, 64], valid [N])``; ``kv = (ptr, stride_blk, stride_tok,
    num_tokens, pbs, unused)`` in elements; ``IS_V32``: d_qk 576 (the tail is columns 512..575),
    else 512; ``WIDE``: ``pbs >= BLOCK_N``. Tokens not attended are never loaded (0)."""
    kv_ptr, stride_blk, stride_tok, num_tokens, pbs, _pbs_log2 = kv
    phys, off, ok, _counted = paged_block_offset(sel, req, sq, pos0, n_valid, pbs, BLOCK_N, WIDE)
    valid = ok & (phys * pbs + off < num_tokens)
    row = kv_ptr + tl.where(valid, phys, 0) * stride_blk + tl.where(valid, off, 0).to(tl.int64) * stride_tok
    k_main = tl.load(row[:, None] + tl.arange(0, 512)[None, :], mask=valid[:, None], other=0.0)
    if IS_V32:
        k_tail = tl.load(row[:, None] + 512 + tl.arange(0, 64)[None, :], mask=valid[:, None], other=0.0)
    else:
        k_tail = tl.zeros([BLOCK_N, 64], dtype=DOT_DTYPE)
    return k_main.to(DOT_DTYPE), k_tail.to(DOT_DTYPE), valid


def cache_args(kc: torch.Tensor, is_v32: bool) -> tuple[tuple, int]:
    """The kernel's ``cache`` tuple for a cache tensor, and its ADDR mode."""
    raw = cache_bytes(kc)
    nb, pbs = raw.shape[0], raw.shape[1]
    pow2 = pbs & (pbs - 1) == 0
    if is_v32 and (nb == 1 or raw.stride(0) == pbs * raw.stride(1)):
        addr = ADDR_CONTIGUOUS_V32.value
    else:
        addr = (ADDR_POW2_PAGE if pow2 else ADDR_GENERAL).value
    return (raw, raw.stride(0), raw.stride(1), nb * pbs, pbs, pbs.bit_length() - 1 if pow2 else 0), addr


def row_cache_args(kc: torch.Tensor) -> tuple:
    """The kernel's ``cache`` tuple for a bf16/fp16 cache ``[num_blocks, pbs, 1, d_qk]`` (strides
    in elements), as :func:`load_paged_rows` reads it."""
    nb, pbs = kc.shape[0], kc.shape[1]
    return (kc, kc.stride(0), kc.stride(1), nb * pbs, pbs, 0)


def gather_consts(lay) -> dict:
    """The constexprs of :func:`load_block_keys` that a cache layout fixes."""
    return dict(D_NOPE=lay.d_nope, TILE=lay.tile, MAIN_TILES=512 // lay.tile, NUM_TILES=lay.num_tiles)


def dot_consts(target: Target, loop: bool = True) -> dict:
    """The dot operands' dtype and precision and the FP8 decode (``FP8_HW``) for ``target``, and
    (``loop``) the loop form. The interpreter's bf16 dot is wrong (docs/design.md, environment), so
    there fp32 operands with exact (ieee) products and a while loop (its range() cannot take
    loaded bounds with NumPy >= 2.4)."""
    interp = target.vendor == "cpu"
    consts = dict(
        DOT_DTYPE=tl.float32 if interp else tl.bfloat16,
        DOT_PREC="ieee" if interp else None,
        FP8_HW=target.fp8_convert,
    )
    if loop:
        consts["FOR_LOOP"] = not interp
    return consts
