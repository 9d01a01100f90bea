"""Gluon pieces every partition of the Hopper kernel shares: tile constants, the Triton-version
shims, the scheduler walk (:func:`partition_row`, :func:`request_blocks`), the query staging and
the output stores."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

__all__ = [
    "D_NOPE",
    "D_ROPE",
    "NUM_STAGES",
    "TPW_ROWS",
    "_async_load",
    "_cta_barrier",
    "opaque_zero",
    "partition_row",
    "request_blocks",
    "stage_q",
    "store_out_staged",
    "tile_ptrs",
]

# Gluon names that changed after Triton 3.6 (the device's version): the CTA barrier
# (gl.thread_barrier -> gl.barrier) and the cp.async copy (async_copy_global_to_shared ->
# async_load, same arguments). Triton 3.9 compiles every variant offline (not run on a GPU).
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

D_NOPE = gl.constexpr(512)
D_ROPE = gl.constexpr(64)
NUM_STAGES = gl.constexpr(2)
# producer register layouts: 8 token rows x 4 threads per warp, 16 bytes per thread. With 4 rows x 8
# threads the stores into the 128-B swizzled K tile took 1.7x the ideal smem wavefronts (ncu)
TPW_ROWS = gl.constexpr(8)


# --------------------------------------------------------------------------------------------- schedule walk
@gluon.jit
def partition_row(meta_ptr):
    """This CTA's scheduler row: (begin_req, end_req, begin_block, end_block, begin_split)."""
    mrow = meta_ptr + gl.program_id(0) * 8
    return gl.load(mrow + 0), gl.load(mrow + 1), gl.load(mrow + 2), gl.load(mrow + 3), gl.load(mrow + 4)


@gluon.jit
def request_blocks(sched, prow, req, HAS_EXTRA: gl.constexpr):
    """The blocks [blk0, blk1) of request ``req`` inside this partition (row ``prow``): over the main
    cache only, or over the main and then the extra cache (``HAS_EXTRA``)."""
    _meta_ptr, _nsplit_ptr, mainblk_ptr, nblk_ptr = sched
    begin_req, end_req, begin_block, end_block, _begin_split = prow
    blk0 = gl.where(req == begin_req, begin_block, 0)
    blk1 = gl.where(req == end_req, end_block, gl.load(nblk_ptr + req))
    if not HAS_EXTRA:
        blk1 = gl.minimum(blk1, gl.load(mainblk_ptr + req))
    return blk0, blk1


# --------------------------------------------------------------------------------------------- query tile
@gluon.jit
def stage_q(q_smem, qr_smem, qrow, qmask, IS_V32: gl.constexpr):
    """A request's query tile (pointers ``qrow`` to its rows' first value) into shared memory."""
    for c in gl.static_range(D_NOPE // 64):
        q_smem.slice(c * 64, 64, dim=1).store(gl.load(qrow + c * 64, mask=qmask, other=0.0))
    if IS_V32:
        qr_smem.store(gl.load(qrow + D_NOPE, mask=qmask, other=0.0))
    fence_async_shared()
    _cta_barrier()


# --------------------------------------------------------------------------------------------- outputs
@gluon.jit
def tile_ptrs(t, row, sq, heads2, cols2):
    """Pointers of an output tile: ``t = (ptr, row stride, s_q stride, head stride)`` (``out`` or the
    split partials ``o_acc``), row ``row`` (int64), query ``sq``, broadcastable ``heads2`` / ``cols2``."""
    ptr, stride_r, stride_s, stride_h = t
    return ptr + row * stride_r + sq * stride_s + heads2 * stride_h + cols2


@gluon.jit
def opaque_zero():
    """0, from an instruction the compiler can neither look into nor move out of a loop."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def store_out_staged(o, buf, out, req, sq, row0, h_q, COL0: gl.constexpr, TRANSPOSED: gl.constexpr = False):
    """``out[req, sq, row0 + r, COL0 + c]`` for the rows ``r`` (heads, those below ``h_q``) and
    columns ``c`` of ``buf`` (``[heads, columns]`` of the staged Q tile, dead by then), from an O
    tile in the wgmma's accumulator layout (bf16; ``TRANSPOSED``: ``Oᵀ [columns, heads]``, the
    narrow consumer's) through ``buf``: each warp stores whole rows in 16-byte pieces, where the
    accumulator layout's own stores are 4 bytes each (2 for ``Oᵀ``; ncu: 11 % of warpgroup 0's
    stall samples in the prefill's epilogue). Ends with a CTA barrier, so ``buf`` may be written
    again."""
    if TRANSPOSED:
        buf.permute([1, 0]).store(o)
    else:
        buf.store(o)
    _cta_barrier()
    OB: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    v = buf.load(OB)
    # (the row offsets from an opaque zero: else the compiler computes the pointers a thread once,
    # before the block loop, and keeps them there, spilled)
    rows = row0 + opaque_zero() + gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, OB))
    cols = COL0 + gl.arange(0, buf.shape[1], layout=gl.SliceLayout(0, OB))
    ptr = tile_ptrs(out, req.to(gl.int64), sq, gl.expand_dims(rows, 1), gl.expand_dims(cols, 0))
    gl.store(ptr, v, mask=gl.expand_dims(rows < h_q, 1))
    _cta_barrier()
