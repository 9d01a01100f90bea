"""The Hopper kernel's ``@gluon.jit`` entry: shared memory, barriers and the warp-specialised
partitions (see the package doc)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .common import D_NOPE, D_ROPE, NUM_STAGES
from .consumer import consumer_pv, consumer_qk
from .narrow import consumer_narrow
from .producer import producer

__all__ = ["_sparse_decode_gluon_kernel"]


@gluon.jit
def _sparse_decode_gluon_kernel(
    q,
    cache,
    sel,
    xcache,
    xsel,
    sink_ptr,
    sched,
    out,
    lse,
    o_acc,
    lse_acc,
    max_logits,
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
    HEADS: gl.constexpr,
    PV_REGS: gl.constexpr,
    HALF_STAGES: gl.constexpr = False,
    NARROW_ROWSUM: gl.constexpr = False,
    NARROW_STAGED: gl.constexpr = False,
    WAIT_PRIOR: gl.constexpr = False,
):
    """Grid ``(num_sm_parts, s_q, ceil(h_q / HEADS))``. The runtime arguments are flat tuples
    (:func:`.host.launch` builds them):

    * ``q = (ptr, stride b, stride s_q, stride head)``;
    * ``cache = (ptr, block stride, token stride, tokens, page size)`` (bf16 rows, ``KV_BF16``:
      ``(ptr, row stride, -, rows, -)``) and ``xcache = (ptr, block stride, tokens, page size)``, the
      extra cache (placeholders without one);
    * ``sel = (indices, stride b, stride s_q, stride topk, topk, topk_length)`` and ``xsel``, the same
      for the extra cache's indices;
    * ``sched = (metadata, acc_rows, main_blocks, num_blocks)``, the scheduler's tensors;
    * ``out = (ptr, stride b, stride s_q, stride head)``, ``lse = (ptr, stride b, stride head,
      stride s_q)``, the split partials ``o_acc = (ptr, stride row, stride s_q, stride head)`` and
      ``lse_acc = (ptr, stride row, stride s_q)``, and ``max_logits = (ptr, stride b, stride head)``.

    ``WAIT_PRIOR``: launched as the programmatic dependent of the kernel that made ``sched`` (the
    schedule made from lengths): every CTA waits for that grid to complete before its partitions
    start.

    The tuples go to the partitions as they are (constexpr arguments must be written out in each
    partition's tuple, or passed as a kernel argument: a tuple held in a variable passes them as
    runtime values)."""
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
    READY_COUNT: gl.constexpr = 1 + PRODUCER_WARPS * 32 if KV_BF16 and ALIGN >= 4 else 1
    # 64-head tiles: both consumer warpgroups release a stage, and hand P and the row factors
    # over through row_smem with the p_full / p_empty pair
    for i in gl.static_range(NS):
        mbarrier.init(ready_bars.index(i), count=READY_COUNT)
        mbarrier.init(empty_bars.index(i), count=2 if HEADS == 64 else 1)

    ring = (k_smem, kr_smem, mask_smem, ready_bars, empty_bars)
    if WAIT_PRIOR:  # a programmatic dependent of the schedule kernel: its table is read only after it completed
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
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
                    consumer_qk,
                    (
                        q, sink_ptr, sched, out, lse, o_acc, lse_acc, max_logits, scale_log2, h_q, q_smem, qr_smem,
                        p_smem, ring, hand, KV_BF16, IS_V32, HAS_EXTRA, HAS_SINK, HAS_MAX_LOGITS,
                    ),
                ),
                (
                    consumer_pv,
                    (sched, out, o_acc, h_q, q_smem, p_smem, ring, hand, KV_BF16, HAS_EXTRA, HAS_MAX_LOGITS),
                ),
                (
                    producer,
                    (
                        cache, xcache, sel, xsel, sched, ring, KV_BF16, IS_V32, HAS_TOPK_LEN, HAS_EXTRA, HAS_EXTRA_LEN,
                        PBS_POW2, PBS_LOG2, ALIGN, 0, 1,
                    ),
                ),
            ],
            [4, PRODUCER_WARPS],
            [PV_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:  # narrow tiles: two producer partitions take alternate blocks
        gl.warp_specialize(
            [
                (
                    consumer_narrow,
                    (
                        q, sink_ptr, sched, out, lse, o_acc, lse_acc, max_logits, scale_log2, h_q, q_smem, qr_smem,
                        p_smem, ring, KV_BF16, IS_V32, HAS_EXTRA, HAS_SINK, HAS_MAX_LOGITS, NARROW_ROWSUM,
                        NARROW_STAGED,
                    ),
                ),
                (
                    producer,
                    (
                        cache, xcache, sel, xsel, sched, ring, KV_BF16, IS_V32, HAS_TOPK_LEN, HAS_EXTRA, HAS_EXTRA_LEN,
                        PBS_POW2, PBS_LOG2, ALIGN, 0, 2,
                    ),
                ),
                (
                    producer,
                    (
                        cache, xcache, sel, xsel, sched, ring, KV_BF16, IS_V32, HAS_TOPK_LEN, HAS_EXTRA, HAS_EXTRA_LEN,
                        PBS_POW2, PBS_LOG2, ALIGN, 1, 2,
                    ),
                ),
            ],
            [PRODUCER_WARPS, PRODUCER_WARPS],
            [PRODUCER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    # (the default partition, after its last store) the combine, launched as this grid's
    # programmatic dependent, may be scheduled once every CTA got here; it still waits for the
    # whole grid to complete before it reads the partials (griddepcontrol.wait)
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )
