"""Dense MLA decode benchmark (``flash_mla_with_kvcache`` without ``indices``), beside FlashMLA.

Rows: FlashMLA's dense decode shapes (page 64, d_qk 576, d_v 512, every request the same context
length, blocks shuffled). Each row times, in this process on the same inputs: FlashMLA 1.0's
dense kernel when ``import flash_mla`` finds it (bf16 only: FlashMLA has no dense FP8 path), ours
on the bf16 cache, and ours on the V3.2 FP8 cache (656-byte records) of the same values. Times
are the median of CUDA-graph replay (``triton.testing.do_bench``, L2 flushed between calls).

FLOPs = 2·b·s_q·h_q·(attended positions)·(d_qk + d_v); causal rows attend ``ctx - s_q + j + 1``
positions for query token ``j``. Bytes = the cache bytes read (b·ctx·bytes per token: 1152 bf16,
656 FP8) plus q and out. ``%copy`` is their share of the measured device-copy GB/s, ``%mma`` the
TFLOP/s share of the measured bf16 matmul.

    PYTHONPATH=.anchors/flashmla:src python -m benchmarks.dense [--quick] [--only b=128] [--json PATH]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import sparse_mla

from . import harness

try:  # FlashMLA's prebuilt package, when on the path (never needed)
    import flash_mla as _flashmla
except Exception:  # noqa: BLE001 - any import failure means "not here"
    _flashmla = None


@dataclass(frozen=True)
class DenseShape:
    b: int
    s_q: int
    h_q: int
    ctx: int
    causal: bool = False
    pbs: int = 64
    d_qk: int = 576
    d_v: int = 512


#: FlashMLA's dense decode rows (its `bench` shapes)
DENSE_SHAPES = [
    DenseShape(128, 1, 128, 4096),
    DenseShape(128, 2, 128, 8192, causal=True),
    DenseShape(64, 1, 128, 32768),
    DenseShape(4, 1, 128, 32768),
    DenseShape(128, 1, 16, 8192),
    DenseShape(1, 1, 128, 4096),
]


def attended(s: DenseShape) -> int:
    """Query-token × position pairs one request attends."""
    if not s.causal:
        return s.s_q * s.ctx
    return sum(s.ctx - s.s_q + j + 1 for j in range(s.s_q))


def inputs(s: DenseShape, seed: int = 0):
    """(q, bf16 cache, FP8 cache, block_table, cache_seqlens) on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = -(-s.ctx // s.pbs)
    total = s.b * nblk
    k = (torch.randn(total, s.pbs, 1, s.d_qk, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    k8 = sparse_mla.quantize_k_cache(k, "V32" if s.d_qk == 576 else "MODEL1")
    table = torch.randperm(total, device="cuda", generator=g).view(s.b, nblk).int()
    lens = torch.full((s.b,), s.ctx, dtype=torch.int32, device="cuda")
    q = (torch.randn(s.b, s.s_q, s.h_q, s.d_qk, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    return q, k, k8, table, lens


def time_graph(call, quick: bool) -> float:
    """Median µs of CUDA-graph replay of ``call``."""
    return harness.graph_replay_us(lambda i: call, 1, quick)


def bench_shape(s: DenseShape, peak_tflops: float, copy_gbs: float, quick: bool) -> list[dict]:
    q, k, k8, table, lens = inputs(s)
    flops = 2 * s.b * s.h_q * attended(s) * (s.d_qk + s.d_v)
    io = q.numel() * 2 + s.b * s.s_q * s.h_q * s.d_v * 2
    rows = []

    def record(who: str, us: float, cache_bytes: int, base: float | None) -> float:
        total = cache_bytes + io
        rows.append(
            dict(
                harness.as_dict(s),
                who=who,
                us=us,
                tflops=flops / us / 1e6,
                gbs=total / us / 1e3,
                pct_mma=100 * flops / us / 1e6 / peak_tflops,
                pct_copy=100 * total / us / 1e3 / copy_gbs,
                ratio_to_flashmla=us / base if base else None,
            )
        )
        return us

    def ours(cache, fp8: bool):
        meta, _ = sparse_mla.get_mla_metadata()
        return lambda: sparse_mla.flash_mla_with_kvcache(
            q, cache, table, lens, s.d_v, meta, causal=s.causal, is_fp8_kvcache=fp8
        )

    base = None
    if _flashmla is not None:
        meta_fm, _ = _flashmla.get_mla_metadata()
        fm = lambda: _flashmla.flash_mla_with_kvcache(q, k, table, lens, s.d_v, meta_fm, causal=s.causal)  # noqa: E731
        base = record("flashmla bf16", time_graph(fm, quick), k.numel() * 2, None)
    record("bf16", time_graph(ours(k, False), quick), k.numel() * 2, base)
    record("fp8", time_graph(ours(k8, True), quick), s.b * s.ctx * 656, base)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--only", help="shape filters k=v,k=v (all must match); several separated by ';'")
    ap.add_argument("--json", help="write the results here (default: benchmarks/results/<date>_<gpu>_dense.json)")
    args = ap.parse_args(argv)
    if not harness.has_cuda("benchmarks.dense"):
        return 2
    shapes = harness.select(DENSE_SHAPES, args.only)
    peak_tflops, copy_gbs = harness.ceilings()
    print(
        f"# {torch.cuda.get_device_name()}: bf16 matmul {peak_tflops:.0f} TFLOP/s, device copy {copy_gbs:.0f} GB/s; "
        f"FlashMLA {'loaded' if _flashmla else 'not importable'}"
    )
    print(f"{'b':>4} {'s_q':>3} {'h_q':>4} {'ctx':>6} {'causal':>6} {'who':>14} {'us':>8} {'TFLOP/s':>8} {'GB/s':>6} "
          f"{'%mma':>5} {'%copy':>5} {'ratio':>6}")  # fmt: skip
    rows = []
    for s in shapes:
        for r in bench_shape(s, peak_tflops, copy_gbs, args.quick):
            rows.append(r)
            ratio = f"{r['ratio_to_flashmla']:.2f}" if r["ratio_to_flashmla"] else "-"
            print(
                f"{s.b:>4} {s.s_q:>3} {s.h_q:>4} {s.ctx:>6} {str(s.causal):>6} {r['who']:>14} {r['us']:>8.1f} "
                f"{r['tflops']:>8.1f} {r['gbs']:>6.0f} {r['pct_mma']:>5.1f} {r['pct_copy']:>5.1f} {ratio:>6}",
                flush=True,
            )
        torch.cuda.empty_cache()
    path = harness.write_results("dense", dict(peak_tflops=peak_tflops, copy_gbs=copy_gbs, rows=rows), args.json)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
