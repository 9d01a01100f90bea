"""Warp-specialised split-KV sparse decode for Hopper (sm_90), written in Gluon: the ``hopper``
backend (V32 and MODEL1 caches, the extra cache, any h_q in 64-head tiles, 16/32-head tiles for
h_q <= 32), also run by the sparse prefill. Twin:
:func:`sparse_mla.decode.reference.sparse_decode_split_reference`.

Same launch contract as :func:`sparse_mla.decode.kernels.portable.launch` (same scheduler partition walk,
same outputs: final bf16 ``out`` + natural-log ``lse`` for unsplit batches, fp32 partial O
normalised by its own sum + log2-space LSE rows ``acc_rows[req] + split`` for split batches,
merged by :mod:`sparse_mla.decode.kernels.combine`).

Files:

* :mod:`.config`: :class:`HopperConfig` (launch parameters), the tile sizes, the measured rules
  that pick the compile-time switches of a launch;
* :mod:`.common`: what every partition shares (scheduler walk, Q staging, output stores);
* :mod:`.producer`: gathers, FP8 conversion, staging into the ring, the bf16-row copy;
* :mod:`.consumer`: the two consumer warpgroups of 64-head tiles;
* :mod:`.narrow`: the one-warpgroup consumer of 16/32-head tiles;
* :mod:`.kernel`: the ``@gluon.jit`` entry (shared memory, barriers, partitions);
* :mod:`.host`: argument tuples, grid, launch (:func:`launch` here adds the default config).

Structure of one CTA (one scheduler partition x one query token x 64 heads), FlashMLA-like:

* **producer partition** (worker, ``HopperConfig.producer_warps`` = 4 warps, ``producer_regs``
  registers; :func:`.producer.producer`): for every 64-index block of the partition's walk it
  takes the block's 64 indices (loaded one block ahead), issues every gather of the block at once
  with 16-byte loads (the 512 NoPE bytes as one ``[64, 4, 128]`` tile, the 4 power-of-two float32
  scales as one load per token, the 64 bf16 RoPE values), only then waits for a free stage of the
  2-stage smem ring, dequantises to bf16 (fp8 -> bf16 is exact, and so is the product with a
  power-of-two scale) and stores the ``[64, 576]`` bf16 K tile into the stage with one store per
  part (128-B swizzled NVMMA layout, wgmma-ready), plus an fp32 mask row (0 for a valid token, -inf
  otherwise). Invalid tokens are never loaded (K row = 0). Then ``fence_async_shared`` and an
  mbarrier arrive on ``ready[stage]``. MODEL1 (``IS_V32`` false): the 448 NoPE bytes as a
  ``[64, 8, 64]`` tile whose 8th slot is masked off, the 7 e8m0 scales (in the block's scale rows
  after its token rows) as one load per token, and the 64 bf16 RoPE values fill the 8th slot: one
  ``[64, 512]`` K tile that is also V (``d_v = d_qk = 512``), no RoPE tile. With an extra cache
  (``HAS_EXTRA``) a request's walk continues past its main-cache blocks into the extra cache's,
  each block gathering from the cache (pointer, strides, page size, indices, length) it belongs
  to. ``KV_BF16`` (the sparse prefill on bf16 rows ``[s_kv, 1, d_qk]``,
  :mod:`sparse_mla.prefill.kernels.hopper`): each block's rows are copied into the stage with
  ``cp.async`` (no conversion, no registers for the tile) and ``ready[stage]`` completes through
  the copies' mbarrier arrivals.
* **consumers split by role** (64-head tiles, :mod:`.consumer`; FlashMLA's organisation):
  warpgroup 0 (:func:`.consumer.consumer_qk`, the default partition, 216 registers) stages
  ``Q [64, 576]`` (MODEL1: ``[64, 512]``) bf16 in smem once per request piece; per block it waits
  ``ready[stage]``, computes the whole ``S = Q Kᵀ [64, 64]`` (N = 64: Q is read from smem once per
  block), runs the exp2 online softmax inside the warpgroup (no cross-warpgroup max/sum), hands P
  (bf16) and the 64 row factors to warpgroup 1 through smem (``p_full`` / ``p_empty`` mbarriers)
  and does ``O[:, :256] += P V`` with ``V = K[:, :512]``; warpgroup 1 (:func:`.consumer.consumer_pv`,
  a worker at ``pv_regs``) rescales its ``O[:, 256:]`` by the row factors and adds ``P V`` on the
  other half, overlapping warpgroup 0's next QKᵀ (128 fp32 accumulator registers per thread each).
  Both release the stage (``empty`` counts 2 arrivals); at the end of a request piece the
  epilogue's row factor travels the same way and each warpgroup stores its half. Against two
  warpgroups that shared every step (QKᵀ on 32 key columns each, row max/sum exchanged through
  smem): consumer alone 151 against 189 µs, whole kernel 236 against 255 µs at b=64/h_q=128, bf16
  prefill at h_q 64 2738 against 3291 µs.

Shared memory (power-of-two shapes only, so Q and K are NoPE [.., 512] + RoPE [.., 64] allocations):
Q + a 2-stage K ring + P + masks + barriers, just under the H100/H200 opt-in limit of 227 KiB.
Registers: ``maxnreg`` for 12 warps (1 CTA/SM); the producer runs at ``producer_regs`` (one
block's gathers in flight), warpgroup 1 at ``pv_regs``, warpgroup 0 at what is left (``setmaxnreg``).
``scripts/gluon_compile_check.py`` prints the compiled budget (smem, registers, spills); where
the time goes is in docs/perf.md, the variants measured and dropped in docs/experiments.md.

**Narrow tiles** (h_q <= 32: tensor-parallel slices; ``HEADS`` = 16 or 32 heads per CTA,
:func:`sparse_mla.decode.scheduler.hopper_head_tile`): the consumer is one warpgroup
(:func:`.narrow.consumer_narrow`) that puts the block's 64 tokens on the wgmma's M and the heads
on its N, ``Sᵀ = K Qᵀ [64, HEADS]`` (K from the stage, Qᵀ a permuted view of the staged Q) and
``Oᵀ += Vᵀ Pᵀ [512, HEADS]`` (Vᵀ a permuted view of the stage, Pᵀ staged in smem), with the
softmax reduced along the tokens; no MMA row is a padded head. Beside it run two 4-warp producer
partitions that take alternate blocks (ring stage = block parity), each with its own barriers,
so one partition's gathers are in flight while the other dequantises (one 8-warp producer moved
in lockstep: 205.9 against 195.2 µs at b=128, h_q=16).

h_q above 32 that is not a multiple of 64 runs in 64-head tiles whose rows past h_q are zero
queries that are never stored.

The kernel takes its runtime arguments as flat tuples (the cache, the indices, the schedule, each
output; :func:`.kernel._sparse_decode_gluon_kernel`) and hands them to the partitions as they are,
with ``ring = (k_smem, kr_smem, mask_smem, ready_bars, empty_bars)``; every partition reads its
scheduler row with :func:`.common.partition_row`.
"""

from __future__ import annotations

import torch

from ...problem import DecodeProblem
from ...scheduler import ScheduleTable
from .common import _cta_barrier
from .config import (
    BLOCK_H,
    BLOCK_N,
    CONSUMER_WARPS,
    HopperConfig,
    resolve_half_stages,
    resolve_narrow_rowsum,
    resolve_narrow_staged_out,
)
from .host import launch as _launch
from .host import record_alignment, rows_alignment
from .kernel import _sparse_decode_gluon_kernel

__all__ = [
    "BLOCK_H",
    "BLOCK_N",
    "CONSUMER_WARPS",
    "DEFAULT_CONFIG",
    "HopperConfig",
    "launch",
    "resolve_half_stages",
    "resolve_narrow_rowsum",
    "resolve_narrow_staged_out",
    "_cta_barrier",
    "record_alignment",
    "rows_alignment",
    "_sparse_decode_gluon_kernel",
]

DEFAULT_CONFIG = HopperConfig()  # frozen: one validated instance serves every default call


def launch(
    p: DecodeProblem,
    table: ScheduleTable,
    config: HopperConfig | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel (and the combine when some batch is split): :func:`.host.launch`, with
    ``config`` None meaning ``DEFAULT_CONFIG`` (read at each call: benchmarks and tests may
    replace it). Returns ``out [b, s_q, h_q, 512]`` bf16, ``lse [b, h_q, s_q]`` fp32."""
    return _launch(p, table, config or DEFAULT_CONFIG, workspace, max_logits)
