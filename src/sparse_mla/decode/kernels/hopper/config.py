"""Launch parameters of the Hopper kernel (:class:`HopperConfig`), its tile sizes, and the measured
rules that turn the config's None fields into the kernel's compile-time switches for a launch.
Host side only: nothing here imports Triton."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BLOCK_H",
    "BLOCK_N",
    "CONSUMER_WARPS",
    "HopperConfig",
    "resolve_half_stages",
    "resolve_narrow_rowsum",
    "resolve_narrow_staged_out",
]

BLOCK_H = 64  # heads per CTA of the wide tiles (wgmma M)
BLOCK_N = 64  # tokens per block (= scheduler block)
CONSUMER_WARPS = 4  # the default partition: one warpgroup (consumer.consumer_qk, or narrow.consumer_narrow)


@dataclass(frozen=True)
class HopperConfig:
    """Launch parameters of the Hopper kernel (defaults: the measured best on the H200, docs/perf.md;
    the alternatives measured and dropped are in docs/experiments.md).

    Attributes:
        producer_warps: warps of the producer partition (8 does not fit: ptxas needs >= 154
            registers per thread at 16 warps).
        producer_regs: registers per producer thread (``setmaxnreg``).
        maxnreg: register cap of the kernel's 12 warps; with 64-head tiles warpgroup 0
            (:func:`.consumer.consumer_qk`) gets what the other two leave, ``3 · maxnreg −
            producer_regs − pv_regs`` (216 at the defaults).
        narrow_producer_warps: warps of each of the two producer partitions beside the
            one-warpgroup consumer of 32-head tiles (:func:`.narrow.consumer_narrow`), where the
            producer's per-token work is what bounds the kernel.
        pv_regs: registers per thread of the P·V warpgroup of 64-head tiles (:func:`.consumer.consumer_pv`).
        narrow16_producer_warps, narrow16_producer_regs, narrow16_maxnreg: the same for 16-head
            tiles (h_q <= 16), whose consumer needs the fewest registers: warps (2, 4 or 8) and
            registers (``setmaxnreg``) of each of the two producer partitions, and the kernel's
            register cap (a multiple of 8) over its ``4 + 2 w`` warps (w: the producer warps); the
            consumer gets ``(4 + 2 w) · narrow16_maxnreg / 4 − 2 w · narrow16_producer_regs / 4``.
        smem_carveout: the percent hint of :func:`sparse_mla.core.launcher.set_smem_carveout`, set
            before every launch: 0 (default) asks for the smallest carveout that fits the kernel,
            i.e. the most L1 (the 169 KB of 16-head tiles get 196 KB and 60 KB of L1; the 64-head
            tiles' 206-230 KB need the largest carveout either way), -1 for Triton's choice (the
            most shared memory: 28 KB of L1 on Hopper; a launch with -1 takes an earlier hint back).
            Measured on the H200 (eager): 16-head V3.2 b=128 193.8 → 152.1 µs, the narrow
            producer's gathers stall on L1 allocation with 28 KB.
        half_stages: 64-head tiles: a ring of three 32-token stages (each 64-token block in two
            consumer steps, Sᵀ with N = 32) instead of two 64-token ones, so that the kernel fits the
            196 KB carveout (60 KB of L1). None (default, :func:`resolve_half_stages`): on for the
            MODEL1 cache's FP8 decode (H200, graph: every MODEL1 row 1.5-10 % faster, b=128 h_q 64
            topk 128 + 512 extra 105.1 → 94.2 µs), off for V3.2 (the consumers' two steps a block
            cost more than the producer gains: 235.4 → 245.3 µs at b=64/h_q 128, 248.6 → 254.0 at
            b=128/h_q 64) and for the sparse prefill (bf16 rows 5199 → 6190 µs at h_q 128; the
            MODEL1 FP8 cache 3333 → 3614).
        narrow_rowsum: 16/32-head tiles: the consumer keeps its softmax row sums per thread and
            reduces them across the warpgroup once a request (after its last block) instead of once
            a block. None (default, :func:`resolve_narrow_rowsum`): on for the V3.2 layout: its FP8
            decode (H200, graph: b=128 h_q 32 218.8 → 206.0 µs, h_q 16 152.7 → 147.2) and the
            sparse prefill (s_q 4096, topk 2048: h_q 32 bf16 rows 2648 → 2307 µs, FP8 cache 3052 →
            2895; h_q 16 1928 → 1895, 2086 → 1981); off for the MODEL1 cache, where it is faster on
            one row and slower on another (graph, h_q 32 topk 128 + 1024 extra: 126.0 → 132.0 µs;
            + 512 extra: 81.5 → 78.9; h_q 16 within 1 %).
        narrow_staged_out: 16/32-head tiles: an unsplit request's Oᵀ is stored transposed into
            the dead Q tile, then written out by whole rows in 16-byte pieces (its accumulator layout
            stores 2 bytes a thread). None (default, :func:`resolve_narrow_staged_out`): on for the
            decode (H200, graph: V3.2 b=128 h_q 32 206.1-206.8 → 203.4 µs, h_q 16 146.8-147.2 →
            145.2-145.6; MODEL1 b=128 h_q 32 topk 128 + 512 extra 81.5-81.8 → 75.8-76.3, + 1024
            126.5-126.8 → 121.0-121.2) and the bf16-row prefill (h_q 32 2297-2311 → 2142-2175 µs,
            h_q 16 1880 → 1798-1800), off for the FP8 cache's prefill (2 % slower at h_q 32:
            producer-bound).
    """

    producer_warps: int = 4
    producer_regs: int = 128
    maxnreg: int = 168
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


def resolve_half_stages(value: bool | None, heads: int, is_v32: bool, kv_bf16: bool, prefill: bool) -> bool:
    """``HopperConfig.half_stages`` for a launch: only for 64-head tiles; None is the measured
    default, on for the MODEL1 cache's FP8 decode only (not for the sparse prefill, measured slower
    there)."""
    if value is None:
        value = not is_v32 and not kv_bf16 and not prefill
    return value and heads == BLOCK_H


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
