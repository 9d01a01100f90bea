"""Warp-specialised split-KV sparse decode for Hopper (sm_90), written in Gluon: the ``hopper``
backend (V32 and MODEL1 caches, the extra cache, any h_q in 64-head tiles). Twin:
:func:`sparse_mla.decode.reference.sparse_decode_split_reference`.

Same launch contract as :func:`sparse_mla.decode.kernels.portable.launch` (same scheduler partition walk,
same outputs: final bf16 ``out`` + natural-log ``lse`` for unsplit batches, fp32 partial O
normalised by its own sum + log2-space LSE rows ``acc_rows[req] + split`` for split batches,
merged by :mod:`.combine`).

Structure of one CTA (one scheduler partition x one query token x 64 heads), FlashMLA-like:

* **producer partition** (worker, ``HopperConfig.producer_warps`` = 4 warps, ``producer_regs`` registers): for every
  64-index block of the partition's walk it takes the block's 64 indices (loaded one block ahead),
  issues every gather of the block at once with 16-byte loads (the 512 NoPE bytes as one
  ``[64, 4, 128]`` tile, the 4 power-of-two float32 scales as one load per token, the 64 bf16
  RoPE values), only then waits for a free stage of the 2-stage smem ring, dequantises to bf16
  (fp8 -> bf16 is exact, and so is the product with a power-of-two scale) and stores the
  ``[64, 576]`` bf16 K tile into the stage with one store per part (128-B swizzled NVMMA layout,
  wgmma-ready), plus an fp32 mask row (0 for a valid token, -inf otherwise). Invalid
  tokens are never loaded (K row = 0). Then ``fence_async_shared`` and an mbarrier arrive on
  ``ready[stage]``. MODEL1 (``IS_V32`` false): the 448 NoPE bytes as a ``[64, 8, 64]`` tile whose
  8th slot is masked off, the 7 e8m0 scales (in the block's scale rows after its token rows) as
  one load per token, and the 64 bf16 RoPE values fill the 8th slot: one ``[64, 512]`` K tile that
  is also V (``d_v = d_qk = 512``), no RoPE tile. With an extra cache (``HAS_EXTRA``) a request's
  walk continues past its main-cache blocks into the extra cache's, each block gathering from the
  cache (pointer, strides, page size, indices, length) it belongs to. ``KV_BF16`` (the sparse
  prefill on bf16 rows ``[s_kv, 1, d_qk]``, :mod:`sparse_mla.prefill.kernels.hopper`): each block's rows
  are copied into the stage with ``cp.async`` (:func:`_copy_block`; no conversion, no registers
  for the tile) and ``ready[stage]`` completes through the copies' mbarrier arrivals.
* **consumers split by role** (64-head tiles; FlashMLA's organisation): warpgroup 0
  (:func:`_consumer_qk`, the default partition, 216 registers) stages ``Q [64, 576]`` (MODEL1:
  ``[64, 512]``) bf16 in smem once per request piece; per block it waits ``ready[stage]``, computes
  the whole ``S = Q Kᵀ [64, 64]`` (N = 64: Q is read from smem once per block), runs the exp2
  online softmax inside the warpgroup (no cross-warpgroup max/sum), hands P (bf16) and the 64 row
  factors to warpgroup 1 through smem (``p_full`` / ``p_empty`` mbarriers) and does
  ``O[:, :256] += P V`` with ``V = K[:, :512]``; warpgroup 1 (:func:`_consumer_pv`, a worker at
  ``pv_regs``) rescales its ``O[:, 256:]`` by the row factors and adds ``P V`` on the other half,
  overlapping warpgroup 0's next QKᵀ (128 fp32 accumulator registers per thread each). Both
  release the stage (``empty`` counts 2 arrivals); at the end of a request piece the epilogue's row
  factor travels the same way and each warpgroup stores its half. It replaced (session 8) two
  warpgroups that shared every step (QKᵀ on 32 key columns each, row max/sum exchanged through
  smem): consumer alone 151 against 189 µs, whole kernel 236 against 255 µs at b=64/h_q=128, bf16
  prefill at h_q 64 2738 against 3291 µs (docs/perf-log.md).

Shared memory (power-of-two shapes only, so Q and K are NoPE [.., 512] + RoPE [.., 64] allocations):
Q + a 2-stage K ring + P + masks + barriers, just under the H100/H200 opt-in limit of 227 KiB.
Registers: ``maxnreg`` for 12 warps (1 CTA/SM); the producer runs at ``producer_regs`` (one
block's gathers in flight), warpgroup 1 at ``pv_regs``, warpgroup 0 at what is left (``setmaxnreg``).
``scripts/gluon_compile_check.py`` prints the compiled budget (smem, registers, spills); where
the time goes (producer alone, consumer alone, ncu stall samples) is in docs/perf-log.md, measured
with the profiling modes of :class:`HopperConfig` (set only by the profiling tools).

**Narrow tiles** (h_q <= 32: tensor-parallel slices; ``HEADS`` = 16 or 32 heads per CTA,
:func:`sparse_mla.decode.scheduler.hopper_head_tile`): the consumer is one warpgroup
(:func:`_consumer_narrow`) that puts the block's 64 tokens on the wgmma's M and the heads on its N,
``Sᵀ = K Qᵀ [64, HEADS]`` (K from the stage, Qᵀ a permuted view of the staged Q) and
``Oᵀ += Vᵀ Pᵀ [512, HEADS]`` (Vᵀ a permuted view of the stage, Pᵀ staged in smem), with the
softmax reduced along the tokens; no MMA row is a padded head. Beside it run two 4-warp producer
partitions that take alternate blocks (ring stage = block parity), each with its own barriers,
so one partition's gathers are in flight while the other dequantises (one 8-warp producer moved
in lockstep: 205.9 against 195.2 µs at b=128, h_q=16, docs/perf-log.md).

h_q above 32 that is not a multiple of 64 runs in 64-head tiles whose rows past h_q are zero
queries that are never stored.

Inside the kernel the partitions take their arguments as tuples: ``sched = (metadata_ptr,
acc_rows_ptr, main_blocks_ptr, num_blocks_ptr)``, ``ring = (k_smem, kr_smem, mask_smem,
ready_bars, empty_bars)`` and one ``(ptr, strides...)`` tuple per output; both read their
partition's scheduler row with :func:`_partition_row`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from ...core.env import LOG2E
from ...core.launcher import carveout_hint
from ...core.launcher import launch as launch_kernel
from ...formats import cache_bytes
from ..problem import DecodeProblem, output_tensors
from ..scheduler import TOPK_BLOCK_SIZE, ScheduleTable, hopper_head_tile
from ..workspace import split_accumulators
from .combine import combine_fwd

__all__ = [
    "HopperConfig",
    "launch",
    "PROFILE_OFF",
    "PROFILE_PRODUCER_ONLY",
    "PROFILE_CONSUMER_ONLY",
    "PROFILE_CACHED_TOKEN",
    "PROFILE_L2_STORE",
]

# Gluon names that changed after Triton 3.6 (the device's version): the CTA barrier
# (gl.thread_barrier -> gl.barrier) and the cp.async copy (async_copy_global_to_shared ->
# async_load, same arguments). Triton 3.9 compiles every variant offline (not run on a GPU).
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

BLOCK_H = 64  # heads per CTA (wgmma M)
BLOCK_N = 64  # tokens per block (= scheduler block)
D_NOPE = gl.constexpr(512)
D_ROPE = gl.constexpr(64)
NUM_STAGES = gl.constexpr(2)
CONSUMER_WARPS = 4  # the default partition: one warpgroup (_consumer_qk, or _consumer_narrow)

# profiling modes (HopperConfig.profile; set only by scripts/profile_gluon.py and the benchmarks'
# variant runner): outputs are garbage in every mode but OFF and L2_STORE
PROFILE_OFF = 0
PROFILE_PRODUCER_ONLY = 1  # the consumer skips its work: the producer's time alone
PROFILE_CONSUMER_ONLY = 2  # the producer skips gathers and conversion: the consumer's time alone
PROFILE_CACHED_TOKEN = 3  # the producer gathers one cache-resident token for every row (no HBM latency)
# the producer also stores the first 32 rows of every converted 64-token tile to a global scratch (36 KB a
# block: the stores a head pair exchanging half-tiles through L2 would add; outputs are right, the
# scratch is the launch's own)
PROFILE_L2_STORE = 4


@dataclass(frozen=True)
class HopperConfig:
    """Launch parameters of the Hopper kernel (defaults: the measured best on the H200, docs/perf-log.md).

    Attributes:
        producer_warps: warps of the producer partition (8 does not fit: ptxas needs >= 154
            registers per thread at 16 warps).
        producer_regs: registers per producer thread (``setmaxnreg``).
        maxnreg: register cap of the kernel's 12 warps; with 64-head tiles warpgroup 0
            (:func:`_consumer_qk`) gets what the other two leave, ``3 · maxnreg − producer_regs −
            pv_regs`` (216 at the defaults).
        profile: a ``PROFILE_*`` mode (profiling tools only).
        narrow_producer_warps: warps of each of the two producer partitions beside the
            one-warpgroup consumer of 32-head tiles (:func:`_consumer_narrow`), where the
            producer's per-token work is what bounds the kernel.
        pv_regs: registers per thread of the P·V warpgroup of 64-head tiles (:func:`_consumer_pv`).
        narrow16_producer_warps, narrow16_producer_regs, narrow16_maxnreg: the same for 16-head
            tiles (h_q <= 16), whose consumer needs the fewest registers: warps (2, 4 or 8) and
            registers (``setmaxnreg``) of each of the two producer partitions, and the kernel's
            register cap (a multiple of 8) over its ``4 + 2 w`` warps (w: the producer warps); the
            consumer gets ``(4 + 2 w) · narrow16_maxnreg / 4 − 2 w · narrow16_producer_regs / 4``.
        smem_carveout: the percent hint of :func:`.launcher.set_smem_carveout`, set before every
            launch: 0 (default) asks for the smallest carveout that fits the kernel, i.e. the
            most L1 (the 169 KB of 16-head tiles get 196 KB and 60 KB of L1; the 64-head tiles'
            206-230 KB need the largest carveout either way), -1 for Triton's choice (the most
            shared memory: 28 KB of L1 on Hopper; a launch with -1 takes an earlier hint back).
            Measured on the H200 (session 15, eager): 16-head V3.2 b=128 193.8 → 152.1 µs, the
            narrow producer's gathers stall on L1 allocation with 28 KB.
        half_stages: 64-head tiles: a ring of three 32-token stages (each 64-token block in two
            consumer steps, Sᵀ with N = 32) instead of two 64-token ones, so that the kernel fits the
            196 KB carveout (60 KB of L1). None (default): on for the MODEL1 cache's FP8 decode
            (measured on the H200 in graph replay, session 16: every MODEL1 row 1.5-10 % faster,
            b=128 h_q 64 topk 128 + 512 extra 105.1 → 94.2 µs), off for V3.2 (the consumers' two
            steps a block cost more than the producer gains: 235.4 → 245.3 µs at b=64/h_q 128,
            248.6 → 254.0 at b=128/h_q 64; taking a block's two stages in one consumer step was
            slower still, 266.7 / 265.7: ``docs/experiments/gluon_half_stage_pairs.patch``) and
            for the sparse prefill (bf16 rows 5199 → 6190 µs at h_q 128; the MODEL1 FP8 cache
            3333 → 3614).
        narrow_rowsum: 16/32-head tiles: the consumer keeps its softmax row sums per thread and
            reduces them across the warpgroup once a request (after its last block) instead of once
            a block. None (default): on for the V3.2 layout: its FP8 decode (H200, session 18, graph:
            b=128 h_q 32 218.8 → 206.0 µs, h_q 16 152.7 → 147.2) and the sparse prefill (session
            19, s_q 4096, topk 2048: h_q 32 bf16 rows 2648 → 2307 µs, FP8 cache 3052 → 2895; h_q 16
            1928 → 1895, 2086 → 1981); off for the MODEL1 cache, where it is faster on one row and
            slower on another (sessions 18 and 19, graph, h_q 32 topk 128 + 1024 extra: 126.0 →
            132.0 µs; + 512 extra: 81.5 → 78.9; h_q 16 within 1 %).
        narrow_staged_out: 16/32-head tiles: an unsplit request's Oᵀ is stored transposed into
            the dead Q tile, then written out by whole rows in 16-byte pieces (its accumulator layout
            stores 2 bytes a thread). None (default): on for the decode (H200, session 20, graph:
            V3.2 b=128 h_q 32 206.1-206.8 → 203.4 µs, h_q 16 146.8-147.2 → 145.2-145.6; MODEL1
            b=128 h_q 32 topk 128 + 512 extra 81.5-81.8 → 75.8-76.3, + 1024 126.5-126.8 →
            121.0-121.2) and the bf16-row prefill (h_q 32 2297-2311 → 2142-2175 µs, h_q 16 1880 →
            1798-1800), off for the FP8 cache's prefill (2 % slower at h_q 32: producer-bound).
    """

    producer_warps: int = 4
    producer_regs: int = 128
    maxnreg: int = 168
    profile: int = PROFILE_OFF
    narrow_producer_warps: int = 4
    pv_regs: int = 160
    narrow16_producer_warps: int = 4
    narrow16_producer_regs: int = 128
    narrow16_maxnreg: int = 168
    smem_carveout: int = 0
    half_stages: bool | None = None
    narrow_rowsum: bool | None = None
    narrow_staged_out: bool | None = None

    def __post_init__(self) -> None:
        for name in ("half_stages", "narrow_rowsum", "narrow_staged_out"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"HopperConfig.{name}: expected a bool or None, got {v!r}")
        c = self.smem_carveout
        if isinstance(c, bool) or not isinstance(c, int) or not -1 <= c <= 100:
            raise ValueError(f"HopperConfig.smem_carveout: expected -1 or a percent in 0..100, got {c!r}")
        names = ("producer_warps", "producer_regs", "maxnreg", "narrow_producer_warps", "pv_regs")
        names += ("narrow16_producer_warps", "narrow16_producer_regs", "narrow16_maxnreg")
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"HopperConfig.{name}: expected a positive int, got {v!r}")
        for name in ("producer_regs", "pv_regs", "narrow16_producer_regs"):
            v = getattr(self, name)  # setmaxnreg takes multiples of 8 in [24, 256]
            if v % 8 or not 24 <= v <= 256:
                raise ValueError(f"HopperConfig.{name}: expected a multiple of 8 in [24, 256], got {v}")
        if self.maxnreg > 168:  # 12 warps x 32 threads x maxnreg (in steps of 8) <= 65536
            raise ValueError(
                f"HopperConfig.maxnreg: expected at most 168 (65536 registers over 12 warps), got {self.maxnreg}"
            )
        left = 3 * (self.maxnreg // 8 * 8) - self.producer_regs - self.pv_regs
        if not 24 <= left <= 256:
            raise ValueError(
                "HopperConfig: warpgroup 0 would get 3 * maxnreg - producer_regs - pv_regs = "
                f"{left} registers, expected 24 to 256"
            )
        w = self.narrow16_producer_warps
        if w not in (2, 4, 8):  # the two partitions fill whole warpgroups (Triton pads them to 4 warps)
            raise ValueError(f"HopperConfig.narrow16_producer_warps: expected 2, 4 or 8, got {w}")
        warps = 4 + 2 * w
        m = self.narrow16_maxnreg
        most = min(248, 65536 // (32 * warps)) // 8 * 8
        if m % 8 or m > most:
            raise ValueError(
                f"HopperConfig.narrow16_maxnreg: expected a multiple of 8 of at most {most} (65536 registers "
                f"over {warps} warps), got {m}"
            )
        left = (m * warps - 2 * w * self.narrow16_producer_regs) // 4
        if not 24 <= left <= 256:
            raise ValueError(
                "HopperConfig: the 16-head consumer would get (4 + 2 w) * narrow16_maxnreg / 4 - 2 w * "
                f"narrow16_producer_regs / 4 = {left} registers, expected 24 to 256"
            )
        modes = (PROFILE_OFF, PROFILE_PRODUCER_ONLY, PROFILE_CONSUMER_ONLY, PROFILE_CACHED_TOKEN, PROFILE_L2_STORE)
        if self.profile not in modes:
            raise ValueError(f"HopperConfig.profile: expected one of the PROFILE_* modes 0-4, got {self.profile!r}")


# producer register layouts: 8 token rows x 4 threads per warp, 16 bytes per thread. With 4 rows x 8
# threads the stores into the 128-B swizzled K tile took 1.7x the ideal smem wavefronts (ncu)
TPW_ROWS = gl.constexpr(8)


# --------------------------------------------------------------------------------------------- schedule walk
@gluon.jit
def _partition_row(meta_ptr):
    """This CTA's scheduler row: (begin_req, end_req, begin_block, end_block, begin_split)."""
    mrow = meta_ptr + gl.program_id(0) * 8
    return gl.load(mrow + 0), gl.load(mrow + 1), gl.load(mrow + 2), gl.load(mrow + 3), gl.load(mrow + 4)


@gluon.jit
def _request_blocks(sched, prow, req, HAS_EXTRA: gl.constexpr):
    """The blocks [blk0, blk1) of request ``req`` inside this partition (row ``prow``): over the main
    cache only, or over the main and then the extra cache (``HAS_EXTRA``)."""
    _meta_ptr, _nsplit_ptr, mainblk_ptr, nblk_ptr = sched
    begin_req, end_req, begin_block, end_block, _begin_split = prow
    blk0 = gl.where(req == begin_req, begin_block, 0)
    blk1 = gl.where(req == end_req, end_block, gl.load(nblk_ptr + req))
    if not HAS_EXTRA:
        blk1 = gl.minimum(blk1, gl.load(mainblk_ptr + req))
    return blk0, blk1


# --------------------------------------------------------------------------------------------- producer
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
    PROFILE: gl.constexpr,
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
    if PROFILE == 3:
        s8 = s8 * 0
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
def _l2_store_probe(kv, rope, scratch, IS_V32: gl.constexpr, P_WARPS: gl.constexpr):
    """:data:`PROFILE_L2_STORE`: rows 0-31 of a converted ``[64, NT, TW]`` tile (and V32's RoPE
    rows) to this CTA's ``[64, 576]`` bf16 region of ``scratch`` (16-byte stores)."""
    NT: gl.constexpr = kv.shape[1]
    TW: gl.constexpr = kv.shape[2]
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [TPW_ROWS, 1, 32 // TPW_ROWS], [P_WARPS, 1, 1], [2, 1, 0])
    cta = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
    base = scratch.to(gl.pointer_type(gl.bfloat16)) + cta.to(gl.int64) * (64 * 576)
    r = gl.arange(0, kv.shape[0], layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    t = gl.arange(0, NT, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    c = gl.arange(0, TW, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    r3 = gl.expand_dims(gl.expand_dims(r, 1), 2)
    t3 = gl.expand_dims(gl.expand_dims(t, 0), 2)
    c3 = gl.expand_dims(gl.expand_dims(c, 0), 1)
    gl.store(base + r3 * 576 + t3 * TW + c3, kv, mask=(r3 < 32) & (t3 >= 0) & (c3 >= 0))
    if IS_V32:
        LDR: gl.constexpr = gl.BlockedLayout([1, 8], [TPW_ROWS, 32 // TPW_ROWS], [P_WARPS, 1], [1, 0])
        rr = gl.expand_dims(gl.arange(0, rope.shape[0], layout=gl.SliceLayout(1, LDR)), 1)
        cc = gl.expand_dims(gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, LDR)), 0)
        gl.store(base + rr * 576 + D_NOPE + cc, rope, mask=(rr < 32) & (cc >= 0))


@gluon.jit
def _stage_block(
    raw, sc, rope, vmask, ring, stage, phase, IS_V32: gl.constexpr, P_WARPS: gl.constexpr, scratch=None,
    L2_STORE: gl.constexpr = False,
):  # fmt: skip
    """Wait for a free ``stage``, dequantise a gathered block into it, and signal ``ready``
    (``L2_STORE``: :data:`PROFILE_L2_STORE`, rows 0-31 of the converted tile to ``scratch`` too)."""
    k_smem, kr_smem, mask_smem, ready_bars, empty_bars = ring
    NT: gl.constexpr = 4 if IS_V32 else 8
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [TPW_ROWS, 1, 32 // TPW_ROWS], [P_WARPS, 1, 1], [2, 1, 0])
    t3 = gl.arange(0, NT, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    t3e = gl.expand_dims(gl.expand_dims(t3, 0), 2)
    # wait for the consumer to free this stage (first lap passes: phase starts at 1)
    mbarrier.wait(empty_bars.index(stage), phase ^ 1)
    # fp8 -> bf16 is exact, and so is the product with a power-of-two scale; one smem
    # store for the whole tile (separate column-slice stores each cost a barrier). (The product
    # taken in bf16x2, 11 % fewer producer instructions, measured no faster: docs/perf-log.md)
    kv = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(sc, 2)).to(gl.bfloat16)
    if L2_STORE:
        _l2_store_probe(kv, rope, scratch, IS_V32, P_WARPS)
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
def _release_to_consumer(ring, stage, phase):
    """Profiling (consumer alone): hand ``stage`` over as it is, once it is free."""
    mbarrier.wait(ring[4].index(stage), phase ^ 1)
    fence_async_shared()
    _cta_barrier()
    mbarrier.arrive(ring[3].index(stage), count=1)


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
def _producer(
    cache,
    xcache,
    sel,
    xsel,
    sched,
    ring,
    scratch,
    KV_BF16: gl.constexpr,
    IS_V32: gl.constexpr,
    HAS_TOPK_LEN: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    HAS_EXTRA_LEN: gl.constexpr,
    PBS_POW2: gl.constexpr,
    PBS_LOG2: gl.constexpr,
    ALIGN: gl.constexpr,
    PROFILE: gl.constexpr,
    PART: gl.constexpr,
    NPART: gl.constexpr,
):
    """Gather, dequantise and stage the K tiles of this partition's blocks (see the module doc).

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
    prow = _partition_row(sched[0])
    begin_req, end_req = prow[0], prow[1]
    it = 0
    req = begin_req
    while req <= end_req:
        blk0, blk1 = _request_blocks(sched, prow, req, HAS_EXTRA)
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
                if PROFILE == 2:
                    _release_to_consumer(ring, stage, phase)
                else:
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
                            idx8, c_ptr, c_sblk, c_ntok, c_pbs, stride_tok, IS_V32, PBS_SHIFT, PBS_LOG2, ALIGN, PROFILE,
                            P_WARPS,
                        )  # fmt: skip
                        _stage_block(raw, sc, rope, vmask, ring, stage, phase, IS_V32, P_WARPS, scratch, PROFILE == 4)
            else:  # two 32-token halves a block, ring stages 2 it and 2 it + 1
                stage_a = (2 * it) % NS
                phase_a = ((2 * it) // NS) & 1
                stage_b = (2 * it + 1) % NS
                phase_b = ((2 * it + 1) // NS) & 1
                if PROFILE == 2:
                    _release_to_consumer(ring, stage_a, phase_a)
                    _release_to_consumer(ring, stage_b, phase_b)
                else:
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
                            idx_a, c_ptr, c_sblk, c_ntok, c_pbs, stride_tok, IS_V32, PBS_SHIFT, PBS_LOG2, ALIGN,
                            PROFILE, P_WARPS,
                        )  # fmt: skip
                        raw_b, sc_b, rope_b, vmask_b = _gather_block(
                            idx_b, c_ptr, c_sblk, c_ntok, c_pbs, stride_tok, IS_V32, PBS_SHIFT, PBS_LOG2, ALIGN,
                            PROFILE, P_WARPS,
                        )  # fmt: skip
                        _stage_block(raw_a, sc_a, rope_a, vmask_a, ring, stage_a, phase_a, IS_V32, P_WARPS)
                        _stage_block(raw_b, sc_b, rope_b, vmask_b, ring, stage_b, phase_b, IS_V32, P_WARPS)
        it = it0 + blk1 - blk0
        req += 1
    if KV_BF16 and ALIGN >= 4:  # nothing in flight when the partition ends
        async_copy.commit_group()
        async_copy.wait_group(0)


@gluon.jit
def _tile_ptrs(t, row, sq, heads2, cols2):
    """Pointers of an output tile: ``t = (ptr, row stride, s_q stride, head stride)`` (``out`` or the
    split partials ``o_acc``), row ``row`` (int64), query ``sq``, broadcastable ``heads2`` / ``cols2``."""
    ptr, stride_r, stride_s, stride_h = t
    return ptr + row * stride_r + sq * stride_s + heads2 * stride_h + cols2


@gluon.jit
def _opaque_zero():
    """0, from an instruction the compiler can neither look into nor move out of a loop."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _store_out_half(
    o, q_smem, out, req, sq, hb, h_q, heads_o, cols_o, hmask_o, HALF: gl.constexpr, STAGED: gl.constexpr
):
    """An unsplit request's O half ``HALF`` (bf16, the wgmma's accumulator layout; rows ``heads_o``,
    columns ``cols_o`` of ``out``, rows ``hmask_o`` stored): stored as it is laid out, or (``STAGED``: the sparse prefill,
    one request a CTA, whose Q tile is dead by then) through Q's half in shared memory
    (:func:`_store_out_staged`)."""
    if STAGED:
        buf = q_smem.slice(HALF * (D_NOPE // 2), D_NOPE // 2, dim=1)
        _store_out_staged(o, buf, out, req, sq, hb * 64, h_q, HALF * (D_NOPE // 2))
    else:
        optr = _tile_ptrs(out, req.to(gl.int64), sq, gl.expand_dims(heads_o, 1), gl.expand_dims(cols_o, 0))
        gl.store(optr, o, mask=hmask_o)


@gluon.jit
def _store_out_staged(o, buf, out, req, sq, row0, h_q, COL0: gl.constexpr, TRANSPOSED: gl.constexpr = False):
    """``out[req, sq, row0 + r, COL0 + c]`` for the rows ``r`` (heads, those below ``h_q``) and
    columns ``c`` of ``buf`` (``[heads, columns]`` of the staged Q tile, dead by then), from an O
    tile in the wgmma's accumulator layout (bf16; ``TRANSPOSED``: ``Oᵀ [columns, heads]``, the
    narrow consumer's) through ``buf``: each warp stores whole rows in 16-byte pieces, where the
    accumulator layout's own stores are 4 bytes each (2 for ``Oᵀ``; ncu, session 19: 11 % of
    warpgroup 0's stall samples in the prefill's epilogue). Ends with a CTA barrier, so ``buf``
    may be written again."""
    if TRANSPOSED:
        buf.permute([1, 0]).store(o)
    else:
        buf.store(o)
    _cta_barrier()
    OB: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    v = buf.load(OB)
    # (the row offsets from an opaque zero: else the compiler computes the pointers a thread once,
    # before the block loop, and keeps them there, spilled)
    rows = row0 + _opaque_zero() + gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, OB))
    cols = COL0 + gl.arange(0, buf.shape[1], layout=gl.SliceLayout(0, OB))
    ptr = _tile_ptrs(out, req.to(gl.int64), sq, gl.expand_dims(rows, 1), gl.expand_dims(cols, 0))
    gl.store(ptr, v, mask=gl.expand_dims(rows < h_q, 1))
    _cta_barrier()


# ---------------------------------------------------------------------- consumers split by role (FlashMLA-like)
@gluon.jit
def _stage_q(q_smem, qr_smem, qrow, qmask, IS_V32: gl.constexpr):
    """A request's query tile (pointers ``qrow`` to its rows' first value) into shared memory."""
    for c in gl.static_range(D_NOPE // 64):
        q_smem.slice(c * 64, 64, dim=1).store(gl.load(qrow + c * 64, mask=qmask, other=0.0))
    if IS_V32:
        qr_smem.store(gl.load(qrow + D_NOPE, mask=qmask, other=0.0))
    fence_async_shared()
    _cta_barrier()


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
    PROFILE: gl.constexpr,
):
    """One step of warpgroup 0 (:func:`_consumer_qk`): ring stage ``it``, P hand-off ``hs``.
    Returns ``(acc, m_i, l_i)``."""
    k_smem, _kr, _mask, ready_bars, empty_bars = ring
    row_smem, p_full, p_empty = hand
    NS: gl.constexpr = k_smem.shape[0]
    stage = it % NS
    mbarrier.wait(ready_bars.index(stage), (it // NS) & 1)
    if KV_BF16:  # cp.async wrote the stage (generic proxy); wgmma reads it (async proxy)
        fence_async_shared()
    kbuf = k_smem.index(stage)
    if PROFILE == 1:  # PROFILE_PRODUCER_ONLY: hand-offs only
        mbarrier.wait(p_empty, (hs & 1) ^ 1)
        _cta_barrier()
        mbarrier.arrive(p_full, count=1)
    else:
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
def _consumer_qk(
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
    PROFILE: gl.constexpr,
):
    """64-head tiles, consumers split by role, warpgroup 0 (the default partition): the whole
    ``S = Q Kᵀ [64, 64]`` (one warpgroup, N = 64: Q is read from smem once per block), the online
    softmax inside the warpgroup (no cross-warpgroup max/sum), P and the row factors handed to
    warpgroup 1 (:func:`_consumer_pv`) through smem, and ``O[:, :256] += P V``.
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
    prow = _partition_row(sched[0])
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
        blk0, blk1 = _request_blocks(sched, prow, req, HAS_EXTRA)
        split = gl.where(req == begin_req, begin_split, 0)
        split_base = gl.load(nsplit_ptr + req)
        n_splits = gl.load(nsplit_ptr + req + 1) - split_base

        if PROFILE != 1:  # the producer alone never reads Q: its 72 KB are not allocated then
            qbase = q_ptr + req.to(gl.int64) * stride_qb + sq * stride_qs
            _stage_q(q_smem, qr_smem, qbase + gl.expand_dims(qr.to(gl.int64) * stride_qh, 1) + gl.expand_dims(qc, 0),
                     qmask, IS_V32)  # fmt: skip

        m_i = gl.full([64], float("-inf"), gl.float32, SROW)
        l_i = gl.zeros([64], gl.float32, SROW)
        acc = gl.zeros([64, D_NOPE // 2], gl.float32, O_L)
        for _step in range(blk0 * STEPS, blk1 * STEPS):
            acc, m_i, l_i = _qk_step(
                it, hs, acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, hand, scale_log2, S_L, O_L, KV_BF16, IS_V32,
                PROFILE,
            )  # fmt: skip
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
            aptr = _tile_ptrs(o_acc, row, sq, gl.expand_dims(heads_o, 1), gl.expand_dims(cols_o, 0))
            gl.store(aptr, o, mask=hmask_o)
            gl.store(lacc_ptr + row * stride_lr + sq * stride_lsq + heads_s, lse2, mask=hmask_s)
        req += 1


@gluon.jit
def _consumer_pv(
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
    PROFILE: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr,
):
    """Warpgroup 1 of the split consumers (a worker partition): ``O[:, 256:] += P V`` with the P and
    row factors warpgroup 0 (:func:`_consumer_qk`) leaves in smem, and ``out[:, 256:]`` (or the
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
    prow = _partition_row(sched[0])
    begin_req, end_req, begin_split = prow[0], prow[1], prow[4]
    heads_o = hb * 64 + gl.arange(0, 64, layout=OROW)
    hmask_o = gl.expand_dims(heads_o < h_q, 1)
    cols_o = D_NOPE // 2 + gl.arange(0, D_NOPE // 2, layout=OCOL)

    it = 0
    hs = 0
    req = begin_req
    while req <= end_req:
        blk0, blk1 = _request_blocks(sched, prow, req, HAS_EXTRA)
        split = gl.where(req == begin_req, begin_split, 0)
        split_base = gl.load(nsplit_ptr + req)
        n_splits = gl.load(nsplit_ptr + req + 1) - split_base
        acc = gl.zeros([64, D_NOPE // 2], gl.float32, O_L)
        for _step in range(blk0 * STEPS, blk1 * STEPS):
            stage = it % NS
            mbarrier.wait(p_full, hs & 1)
            if PROFILE != 1:
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
            aptr = _tile_ptrs(o_acc, row, sq, gl.expand_dims(heads_o, 1), gl.expand_dims(cols_o, 0))
            gl.store(aptr, o, mask=hmask_o)
        req += 1


@gluon.jit
def _consumer_narrow(
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
    KV_BF16: gl.constexpr,
    IS_V32: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr,
    PROFILE: gl.constexpr,
    ROWSUM_PER_THREAD: gl.constexpr,
    STAGED_OUT: gl.constexpr = False,
):
    """The consumer of 16- or 32-head tiles (one warpgroup): the block's 64 tokens are the wgmmas' M and the
    ``HEADS`` heads their N, ``Sᵀ = K Qᵀ [64, HEADS]`` and ``Oᵀ += Vᵀ Pᵀ [512, HEADS]``, so no MMA row
    is a padded head; the softmax reduces along the tokens (axis 0)."""
    q_ptr, stride_qb, stride_qs, stride_qh = q
    _meta_ptr, nsplit_ptr, _mainblk_ptr, _nblk_ptr = sched
    lse_ptr, stride_lb, stride_lh, stride_ls = lse
    lacc_ptr, stride_lr, stride_lsq = lse_acc
    ml_ptr, stride_mlb, stride_mlh = max_logits
    k_smem, kr_smem, mask_smem, ready_bars, empty_bars = ring
    NS: gl.constexpr = k_smem.shape[0]  # ring stages (of 64 tokens: the tokens are the wgmmas' M)
    HEADS: gl.constexpr = q_smem.shape[0]
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEADS, 16])
    SROW: gl.constexpr = gl.SliceLayout(1, S_L)  # tokens
    SCOL: gl.constexpr = gl.SliceLayout(0, S_L)  # heads
    OROW: gl.constexpr = gl.SliceLayout(1, S_L)  # output columns (same distributed layout, M = 512)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    sq = gl.program_id(1)
    hb = gl.program_id(2)
    prow = _partition_row(sched[0])
    begin_req, end_req, begin_split = prow[0], prow[1], prow[4]

    heads = hb * HEADS + gl.arange(0, HEADS, layout=SCOL)
    hmask = heads < h_q
    hmask_o = gl.expand_dims(hmask, 0)
    cols_o = gl.arange(0, D_NOPE, layout=OROW)
    qr = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, QL))
    qc = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    qmask = gl.expand_dims(qr < h_q, 1)
    if HAS_SINK:
        sink_log2 = gl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634

    it = 0
    req = begin_req
    while req <= end_req:
        blk0, blk1 = _request_blocks(sched, prow, req, HAS_EXTRA)
        split = gl.where(req == begin_req, begin_split, 0)
        split_base = gl.load(nsplit_ptr + req)
        n_splits = gl.load(nsplit_ptr + req + 1) - split_base

        qbase = q_ptr + req.to(gl.int64) * stride_qb + sq * stride_qs
        _stage_q(q_smem, qr_smem, qbase + gl.expand_dims(qr.to(gl.int64) * stride_qh, 1) + gl.expand_dims(qc, 0),
                 qmask, IS_V32)  # fmt: skip

        m_i = gl.full([HEADS], float("-inf"), gl.float32, SCOL)
        # ROWSUM_PER_THREAD (HopperConfig.narrow_rowsum): the row sums stay per thread (each
        # thread's tokens of every head) and are reduced across the warpgroup once, after the last
        # block: one cross-warp reduction a block less
        if ROWSUM_PER_THREAD:
            l_part = gl.zeros([64, HEADS], gl.float32, S_L)
        else:
            l_i = gl.zeros([HEADS], gl.float32, SCOL)
        acc = gl.zeros([D_NOPE, HEADS], gl.float32, S_L)
        for _blk in range(blk0, blk1):
            stage = it % NS
            phase = (it // NS) & 1
            mbarrier.wait(ready_bars.index(stage), phase)
            if KV_BF16:
                # the stage was written by cp.async (generic proxy) and is read by wgmma (async
                # proxy); the writers cannot fence after their copies land, so the reader does
                fence_async_shared()
            if PROFILE == 1:  # PROFILE_PRODUCER_ONLY
                _cta_barrier()
                mbarrier.arrive(empty_bars.index(stage), count=1)
            else:
                kbuf = k_smem.index(stage)
                s = warpgroup_mma(kbuf, q_smem.permute([1, 0]), gl.zeros([64, HEADS], gl.float32, S_L), use_acc=False)
                if IS_V32:
                    s = warpgroup_mma(kr_smem.index(stage), qr_smem.permute([1, 0]), s)
                bias = mask_smem.index(stage).load(SROW)
                s = gl.where(gl.expand_dims(bias, 1) == 0.0, s * scale_log2, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, axis=0))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - gl.expand_dims(m_safe, 0))
                if ROWSUM_PER_THREAD:
                    l_part = l_part * gl.expand_dims(alpha, 0) + p
                else:
                    l_i = l_i * alpha + gl.sum(p, axis=0)
                m_i = m_new
                acc = acc * gl.expand_dims(alpha, 0)
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                _cta_barrier()
                acc = warpgroup_mma(kbuf.permute([1, 0]), p_smem, acc)
                _cta_barrier()
                mbarrier.arrive(empty_bars.index(stage), count=1)
            it += 1

        if ROWSUM_PER_THREAD:
            l_i = gl.sum(l_part, axis=0)
        lonely = l_i == 0.0
        l_safe = gl.where(lonely, 1.0, l_i)
        m_safe2 = gl.where(lonely, 0.0, m_i)
        lse2 = gl.where(lonely, float("-inf"), gl.log2(l_safe) + m_safe2)
        if n_splits <= 1:
            denom = l_safe
            if HAS_SINK:
                denom += gl.exp2(sink_log2 - m_safe2)
            scale_col = gl.where(lonely, 0.0, 1.0 / denom)
            o = acc * gl.expand_dims(scale_col, 0)
            if STAGED_OUT:  # Oᵀ through the Q tile (_store_out_staged; this warpgroup stages the next Q itself)
                _store_out_staged(o.to(gl.bfloat16), q_smem, out, req, sq, hb * HEADS, h_q, 0, True)
            else:
                optr = _tile_ptrs(out, req.to(gl.int64), sq, gl.expand_dims(heads, 0), gl.expand_dims(cols_o, 1))
                gl.store(optr, o.to(gl.bfloat16), mask=hmask_o)
            lse_v = gl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
            gl.store(lse_ptr + req.to(gl.int64) * stride_lb + heads * stride_lh + sq * stride_ls, lse_v, mask=hmask)
            if HAS_MAX_LOGITS:
                gl.store(
                    ml_ptr + req.to(gl.int64) * stride_mlb + heads * stride_mlh,
                    gl.where((l_i != l_i) & (m_i != float("inf")), float("nan"), m_i * 0.6931471805599453),
                    mask=hmask,
                )
        else:
            row = (split_base + split).to(gl.int64)
            o = acc * gl.expand_dims(1.0 / l_safe, 0)
            aptr = _tile_ptrs(o_acc, row, sq, gl.expand_dims(heads, 0), gl.expand_dims(cols_o, 1))
            gl.store(aptr, o, mask=hmask_o)
            gl.store(lacc_ptr + row * stride_lr + sq * stride_lsq + heads, lse2, mask=hmask)
        req += 1


# --------------------------------------------------------------------------------------------- kernel
@gluon.jit
def _sparse_decode_gluon_kernel(
    q_ptr,
    stride_qb,
    stride_qs,
    stride_qh,
    kv_ptr,
    stride_blk,
    stride_tok,
    num_tokens,
    pbs,
    idx_ptr,
    stride_ib,
    stride_is,
    stride_it,
    topk,
    topk_len_ptr,
    xkv_ptr,
    x_stride_blk,
    x_num_tokens,
    x_pbs,
    xidx_ptr,
    x_stride_ib,
    x_stride_is,
    x_stride_it,
    x_topk,
    x_len_ptr,
    sink_ptr,
    meta_ptr,
    nsplit_ptr,
    mainblk_ptr,
    nblk_ptr,
    out_ptr,
    stride_ob,
    stride_os,
    stride_oh,
    lse_ptr,
    stride_lb,
    stride_lh,
    stride_ls,
    oacc_ptr,
    stride_ar,
    stride_as,
    stride_ah,
    lacc_ptr,
    stride_lr,
    stride_lsq,
    ml_ptr,
    stride_mlb,
    stride_mlh,
    scale_log2,
    h_q,
    KV_BF16: gl.constexpr,
    IS_V32: gl.constexpr,
    HAS_TOPK_LEN: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    HAS_EXTRA_LEN: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr,
    PBS_POW2: gl.constexpr,
    PBS_LOG2: gl.constexpr,
    ALIGN: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    PROFILE: gl.constexpr,
    HEADS: gl.constexpr,
    PV_REGS: gl.constexpr,
    HALF_STAGES: gl.constexpr = False,
    NARROW_ROWSUM: gl.constexpr = False,
    NARROW_STAGED: gl.constexpr = False,
):
    """Grid ``(num_sm_parts, s_q, ceil(h_q / HEADS))``; flat arguments (``scripts/gluon_compile_check.py``
    builds the signature from their names), grouped into tuples for the partitions."""
    SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # power-of-two shapes only: Q and K are kept as NoPE [.., 512] + RoPE [.., 64] tiles
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, D_NOPE], SW)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, D_ROPE], SW)
    # the ring: NUM_STAGES stages of a 64-token block, or (HALF_STAGES, 64-head tiles) three of 32
    # tokens (a block in two steps): 189 KB of shared memory instead of 225 at V3.2 (169 KB at
    # MODEL1), so that the 196 KB carveout leaves 60 KB of L1 to the producer's gathers
    SUB: gl.constexpr = 32 if HALF_STAGES and HEADS == 64 else 64
    NS: gl.constexpr = 3 if SUB == 32 else NUM_STAGES
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, SUB, D_NOPE], SW)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, SUB, D_ROPE], SW)
    # P (bf16): [64 heads, 64 tokens] for 64-head tiles, [64 tokens, HEADS] for narrow ones
    P_COLS: gl.constexpr = SUB if HEADS == 64 else HEADS
    p_smem = gl.allocate_shared_memory(
        gl.bfloat16, [64, P_COLS], gl.NVMMASharedLayout.get_default_for([64, P_COLS], gl.bfloat16)
    )
    mask_smem = gl.allocate_shared_memory(
        gl.float32, [NS, SUB], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    )
    ready_bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    # ready: the producer's one plain arrive, and (KV_BF16 with cp.async) each producer thread's
    # cp.async arrive (.noinc: counted here) when its copies have landed
    READY_COUNT: gl.constexpr = 1 + PRODUCER_WARPS * 32 if KV_BF16 and ALIGN >= 4 and PROFILE != 2 else 1
    # 64-head tiles: both consumer warpgroups release a stage, and hand P and the row factors
    # over through row_smem with the p_full / p_empty pair
    for i in gl.static_range(NS):
        mbarrier.init(ready_bars.index(i), count=READY_COUNT)
        mbarrier.init(empty_bars.index(i), count=2 if HEADS == 64 else 1)

    sched = (meta_ptr, nsplit_ptr, mainblk_ptr, nblk_ptr)
    ring = (k_smem, kr_smem, mask_smem, ready_bars, empty_bars)
    # (constexpr arguments must be written out in each partition's tuple: a tuple held in a
    # variable passes them as runtime values)
    if HEADS == 64:
        row_smem = gl.allocate_shared_memory(
            gl.float32, [64], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        )
        hand_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(hand_bars.index(0), count=1)
        mbarrier.init(hand_bars.index(1), count=1)
        hand = (row_smem, hand_bars.index(0), hand_bars.index(1))
        gl.warp_specialize(
            [
                (
                    _consumer_qk,
                    (
                        (q_ptr, stride_qb, stride_qs, stride_qh),
                        sink_ptr,
                        sched,
                        (out_ptr, stride_ob, stride_os, stride_oh),
                        (lse_ptr, stride_lb, stride_lh, stride_ls),
                        (oacc_ptr, stride_ar, stride_as, stride_ah),
                        (lacc_ptr, stride_lr, stride_lsq),
                        (ml_ptr, stride_mlb, stride_mlh),
                        scale_log2,
                        h_q,
                        q_smem,
                        qr_smem,
                        p_smem,
                        ring,
                        hand,
                        KV_BF16,
                        IS_V32,
                        HAS_EXTRA,
                        HAS_SINK,
                        HAS_MAX_LOGITS,
                        PROFILE,
                    ),
                ),
                (
                    _consumer_pv,
                    (
                        sched,
                        (out_ptr, stride_ob, stride_os, stride_oh),
                        (oacc_ptr, stride_ar, stride_as, stride_ah),
                        h_q,
                        q_smem,
                        p_smem,
                        ring,
                        hand,
                        KV_BF16,
                        HAS_EXTRA,
                        PROFILE,
                        HAS_MAX_LOGITS,
                    ),
                ),
                (
                    _producer,
                    (
                        (kv_ptr, stride_blk, stride_tok, num_tokens, pbs),
                        (xkv_ptr, x_stride_blk, x_num_tokens, x_pbs),
                        (idx_ptr, stride_ib, stride_is, stride_it, topk, topk_len_ptr),
                        (xidx_ptr, x_stride_ib, x_stride_is, x_stride_it, x_topk, x_len_ptr),
                        sched,
                        ring,
                        ml_ptr,
                        KV_BF16,
                        IS_V32,
                        HAS_TOPK_LEN,
                        HAS_EXTRA,
                        HAS_EXTRA_LEN,
                        PBS_POW2,
                        PBS_LOG2,
                        ALIGN,
                        PROFILE,
                        0,
                        1,
                    ),
                ),
            ],
            [4, PRODUCER_WARPS],
            [PV_REGS, PRODUCER_REGS],
        )
    else:  # narrow tiles: two producer partitions take alternate blocks
        gl.warp_specialize(
            [
                (
                    _consumer_narrow,
                    (
                        (q_ptr, stride_qb, stride_qs, stride_qh),
                        sink_ptr,
                        sched,
                        (out_ptr, stride_ob, stride_os, stride_oh),
                        (lse_ptr, stride_lb, stride_lh, stride_ls),
                        (oacc_ptr, stride_ar, stride_as, stride_ah),
                        (lacc_ptr, stride_lr, stride_lsq),
                        (ml_ptr, stride_mlb, stride_mlh),
                        scale_log2,
                        h_q,
                        q_smem,
                        qr_smem,
                        p_smem,
                        ring,
                        KV_BF16,
                        IS_V32,
                        HAS_EXTRA,
                        HAS_SINK,
                        HAS_MAX_LOGITS,
                        PROFILE,
                        NARROW_ROWSUM,
                        NARROW_STAGED,
                    ),
                ),
                (
                    _producer,
                    (
                        (kv_ptr, stride_blk, stride_tok, num_tokens, pbs),
                        (xkv_ptr, x_stride_blk, x_num_tokens, x_pbs),
                        (idx_ptr, stride_ib, stride_is, stride_it, topk, topk_len_ptr),
                        (xidx_ptr, x_stride_ib, x_stride_is, x_stride_it, x_topk, x_len_ptr),
                        sched,
                        ring,
                        ml_ptr,
                        KV_BF16,
                        IS_V32,
                        HAS_TOPK_LEN,
                        HAS_EXTRA,
                        HAS_EXTRA_LEN,
                        PBS_POW2,
                        PBS_LOG2,
                        ALIGN,
                        PROFILE,
                        0,
                        2,
                    ),
                ),
                (
                    _producer,
                    (
                        (kv_ptr, stride_blk, stride_tok, num_tokens, pbs),
                        (xkv_ptr, x_stride_blk, x_num_tokens, x_pbs),
                        (idx_ptr, stride_ib, stride_is, stride_it, topk, topk_len_ptr),
                        (xidx_ptr, x_stride_ib, x_stride_is, x_stride_it, x_topk, x_len_ptr),
                        sched,
                        ring,
                        ml_ptr,
                        KV_BF16,
                        IS_V32,
                        HAS_TOPK_LEN,
                        HAS_EXTRA,
                        HAS_EXTRA_LEN,
                        PBS_POW2,
                        PBS_LOG2,
                        ALIGN,
                        PROFILE,
                        1,
                        2,
                    ),
                ),
            ],
            [PRODUCER_WARPS, PRODUCER_WARPS],
            [PRODUCER_REGS, PRODUCER_REGS],
        )
    # (the default partition, after its last store) the combine, launched as this grid's
    # programmatic dependent, may be scheduled once every CTA got here; it still waits for the
    # whole grid to complete before it reads the partials (griddepcontrol.wait)
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


# --------------------------------------------------------------------------------------------- launcher
def resolve_narrow_rowsum(value: bool | None, heads: int, is_v32: bool) -> bool:
    """``HopperConfig.narrow_rowsum`` for a launch: only for 16/32-head tiles; None is the measured
    default, on for the V3.2 layout (its FP8 decode, and the sparse prefill from either ``kv`` form),
    off for MODEL1."""
    if value is None:
        value = is_v32
    return value and heads < BLOCK_H


def resolve_narrow_staged_out(value: bool | None, heads: int, kv_bf16: bool, prefill: bool) -> bool:
    """``HopperConfig.narrow_staged_out`` for a launch: only for 16/32-head tiles; None is the
    measured default, on for the decode and the bf16-row prefill, off for the FP8 cache's prefill."""
    if value is None:
        value = kv_bf16 or not prefill
    return value and heads < BLOCK_H


def _record_alignment(raw: torch.Tensor, is_v32: bool, extra: torch.Tensor | None) -> int:
    """The largest power of two (at most 16) that divides every token record's byte address in the
    caches: the gathers are 16-byte loads when it is 16 (every FlashMLA layout), narrower for views
    whose block or token stride is not (a dense copy of a padded MODEL1 cache: 61 * 584 bytes)."""
    vals = [raw.data_ptr(), raw.stride(0), raw.stride(1) if is_v32 else 576]
    if extra is not None:
        x = cache_bytes(extra)
        vals += [x.data_ptr(), x.stride(0), x.stride(1) if is_v32 else 576]
    a = 16
    for v in vals:
        while v % a:
            a //= 2
    return a


def _rows_alignment(kv: torch.Tensor) -> int:
    """``ALIGN`` of bf16 rows (``KV_BF16``): the largest power of two (at most 16) that divides every
    row's byte address as Triton can know it: 2 when the base pointer is not 16-byte aligned
    (Triton specialises a pointer on 16-byte alignment only), else what the row stride allows."""
    if kv.data_ptr() % 16:
        return 2
    v, a = kv.stride(0) * kv.element_size(), 16
    while v % a:
        a //= 2
    return a


_DEFAULT_CONFIG = HopperConfig()  # frozen: one validated instance serves every default call


def launch(
    p: DecodeProblem,
    table: ScheduleTable,
    config: HopperConfig | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the warp-specialised kernel, and the combine kernel when some batch is split.

    Args:
        p: a validated, non-empty problem on an sm_90 device (the dispatcher checks, :mod:`.backends`);
            its ``k_cache`` may also be bf16 rows ``[s_kv, 1, d_qk]`` (the sparse prefill's ``kv``,
            :mod:`sparse_mla.prefill.kernels.hopper`; no extra cache), indexed by row.
        table: its schedule on ``p.q``'s device, sized for 64-head tiles.
        config: launch parameters (default :class:`HopperConfig`).
        workspace: ``(o_accum, lse_accum)`` of at least ``table.num_acc_rows`` rows
            (:func:`.workspace.split_accumulators`), or None to allocate them.
        max_logits: ``[b, h_q]`` fp32 (any strides) to also receive each row's largest
            ``q·k·sm_scale`` (-inf for a row with no valid key), or None. Only for ``s_q = 1``
            and a schedule of one whole request a partition (the sparse prefill's,
            :func:`sparse_mla.prefill.kernels.hopper.prefill_table`): the consumers then store O through
            the request's staged Q tile, which a second request in the partition would overwrite.

    Returns:
        ``out [b, s_q, h_q, 512]`` bf16, ``lse [b, h_q, s_q]`` fp32.
    """
    config = config or _DEFAULT_CONFIG
    q = p.q
    b, s_q, h_q, _ = q.shape
    assert TOPK_BLOCK_SIZE == BLOCK_N and p.layout.name in ("V32", "MODEL1")
    is_v32 = p.layout.name == "V32"
    dev = q.device
    out, lse = output_tensors(p)
    o_acc, l_acc = workspace or split_accumulators(table.num_acc_rows, s_q, h_q, p.d_v, dev)
    if max_logits is not None:
        assert s_q == 1 and not table.any_split and table.num_sm_parts == b, (
            "max_logits: only for s_q = 1 and one whole request a partition"
        )
        ml = (max_logits, max_logits.stride(0), max_logits.stride(1))
    else:
        ml = (l_acc, 0, 0)  # never written
    kv_bf16 = p.k_cache.dtype == torch.bfloat16
    if kv_bf16:  # rows [s_kv, 1, d_qk]: (pointer, row stride, -, s_kv, -)
        assert p.extra_k_cache is None, "bf16 rows: no extra cache"
        rows = p.k_cache if p.k_cache.shape[0] else q  # s_kv = 0: every index is invalid, nothing is read
        pbs = 1
        kv_args = (rows, rows.stride(0), 0, p.k_cache.shape[0], 1)
        align = _rows_alignment(rows)
    else:
        raw = cache_bytes(p.k_cache)
        pbs = raw.shape[1]
        kv_args = (raw, raw.stride(0), raw.stride(1) if is_v32 else 576, raw.shape[0] * pbs, pbs)
        align = _record_alignment(raw, is_v32, p.extra_k_cache)
    pow2 = pbs & (pbs - 1) == 0
    dummy_i32 = table.acc_rows
    if p.extra_k_cache is not None:
        xraw = cache_bytes(p.extra_k_cache)
        xi = p.extra_indices
        xargs = (xraw, xraw.stride(0), xraw.shape[0] * xraw.shape[1], xraw.shape[1], xi, *xi.stride(), xi.shape[2])
        xargs += (p.extra_topk_length if p.extra_topk_length is not None else dummy_i32,)
    else:  # placeholders (never read)
        xargs = (kv_args[0], 0, 0, 1, dummy_i32, 0, 0, 0, 0, dummy_i32)
    heads = hopper_head_tile(h_q)
    narrow = heads < BLOCK_H
    if heads == 16:
        pw, preg, maxnreg = config.narrow16_producer_warps, config.narrow16_producer_regs, config.narrow16_maxnreg
    else:
        pw = config.narrow_producer_warps if narrow else config.producer_warps
        preg, maxnreg = config.producer_regs, config.maxnreg
    grid = (table.num_sm_parts, s_q, -(-h_q // heads))
    if config.profile == PROFILE_L2_STORE:  # the probe's scratch: 64 x 576 bf16 per CTA, in the unused slot
        assert max_logits is None, "PROFILE_L2_STORE: decode calls only"
        ml = (torch.empty(grid[0] * grid[1] * grid[2] * 64 * 576, dtype=torch.bfloat16, device=dev), 0, 0)
    args = (
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        *kv_args,
        p.indices,
        *p.indices.stride(),
        p.indices.shape[2],
        p.topk_length if p.topk_length is not None else dummy_i32,
        *xargs,
        p.attn_sink if p.attn_sink is not None else l_acc,
        table.metadata,
        table.acc_rows,
        table.main_blocks,
        table.num_blocks_t,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse,
        lse.stride(0),
        lse.stride(1),
        lse.stride(2),
        o_acc,
        o_acc.stride(0),
        o_acc.stride(1),
        o_acc.stride(2),
        l_acc,
        l_acc.stride(0),
        l_acc.stride(1),
        *ml,
        p.sm_scale * LOG2E,
        h_q,
    )
    # half_stages=None: on for the MODEL1 cache's FP8 decode only (not for the sparse prefill, the
    # call with max_logits: measured slower there); narrow tiles have no half stages
    half_stages = config.half_stages
    if half_stages is None:
        half_stages = not is_v32 and not kv_bf16 and max_logits is None
    half_stages = half_stages and heads == 64
    narrow_rowsum = resolve_narrow_rowsum(config.narrow_rowsum, heads, is_v32)
    consts = dict(
        ALIGN=align,
        KV_BF16=kv_bf16,
        IS_V32=is_v32,
        HAS_TOPK_LEN=p.topk_length is not None,
        HAS_EXTRA=p.extra_k_cache is not None,
        HAS_EXTRA_LEN=p.extra_topk_length is not None,
        HAS_SINK=p.attn_sink is not None,
        HAS_MAX_LOGITS=max_logits is not None,
        PBS_POW2=pow2,
        PBS_LOG2=pbs.bit_length() - 1 if pow2 else 0,
        PRODUCER_WARPS=pw,
        PRODUCER_REGS=preg,
        PROFILE=config.profile,
        HEADS=heads,
        PV_REGS=config.pv_regs,
        HALF_STAGES=half_stages,
        NARROW_ROWSUM=narrow_rowsum,
        NARROW_STAGED=resolve_narrow_staged_out(config.narrow_staged_out, heads, kv_bf16, max_logits is not None),
    )
    options = {"num_warps": CONSUMER_WARPS, "maxnreg": maxnreg}
    # the carveout hint, set before the first launch too (a graph captured at the first call keeps it)
    launch_kernel(_sparse_decode_gluon_kernel, grid, args, consts, options, carveout_hint(config.smem_carveout))
    if table.any_split:
        combine_fwd(o_acc, l_acc, table.acc_rows, out, lse, p.attn_sink, max_pieces=table.max_pieces, pdl=True)
    return out, lse
