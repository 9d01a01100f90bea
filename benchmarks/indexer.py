"""Indexer benchmark (``sparse_mla.indexer``): the paged decode logits, the prefill logits and the
top-k, against the measured ceilings (issue targets in the closing notes).

* paged logits: b=128, next_n=2, H=64, D=128, 32K-token contexts, page 64: GB/s on the key-cache
  bytes read (``(D + 4)`` per context token), % of the device-copy bandwidth;
* prefill logits: s_q=4096, s_kv=32K, H=64, D=128, causal ``[0, s_kv - s_q + i + 1)`` ranges: TFLOP/s on
  the work inside the ranges (``2·H·D`` per visible pair), % of the FP8 matmul peak
  (``torch._scaled_mm`` 8192³ where available, else the bf16 peak);
* top-k 2048 of 32K per row, 256 rows: µs against one read of the logits at copy bandwidth and
  against ``torch.topk``, sorted (rank order) and unsorted (``sorted=False``, both libraries).

    python -m benchmarks.indexer [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys

import torch

import sparse_mla as flash_mla

from . import harness


def fp8_peak_tflops() -> float | None:
    """``torch._scaled_mm`` e4m3 8192³ TFLOP/s, or None where it is not available."""
    try:
        a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        us = harness.median_us(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
        return 2 * 8192**3 / (us * 1e-6) / 1e12
    except Exception:  # older GPUs / builds without FP8 matmul
        return None


def bench_paged(quick: bool, copy_gbs: float) -> dict:
    b, next_n, h, d, blk, ctx_len = 128, 2, 64, 128, 64, 32768
    nblk = ctx_len // blk
    cache = torch.randint(0, 255, (b * nblk, blk, 1, d + 4), dtype=torch.uint8, device="cuda")
    cache.view(b * nblk, -1)[:, blk * d :].view(torch.float32).fill_(0.01)
    table = torch.randperm(b * nblk, device="cuda").view(b, nblk).int()
    q = torch.randn(b, next_n, h, d, device="cuda").to(torch.float8_e4m3fn)
    w = torch.rand(b * next_n, h, device="cuda")
    ctx = torch.full((b,), ctx_len, dtype=torch.int32, device="cuda")
    meta = flash_mla.get_paged_mqa_logits_metadata(ctx, blk, torch.cuda.get_device_properties(0).multi_processor_count)
    us = harness.median_us(lambda: flash_mla.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, ctx_len), quick)
    gbs = b * ctx_len * (d + 4) / (us * 1e-6) / 1e9
    # the pointer path (gathers through cp.async; what other GPUs run) on the same call, for scale
    from sparse_mla.indexer import kernels as K

    out = torch.empty(b * next_n, ctx_len, device="cuda")
    qb = q.view(torch.uint8)
    us_ptr = harness.median_us(
        lambda: K.launch_paged_mqa_logits(qb, cache, w, ctx, table, out, ctx_len, config=dict(tma=False)), quick
    )
    return dict(
        kind="paged_logits", b=b, next_n=next_n, h=h, d=d, ctx=ctx_len, us=us, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
        us_pointer_path=us_ptr,
    )  # fmt: skip


def bench_prefill(quick: bool, peak: float) -> dict:
    s_q, s_kv, h, d = 4096, 32768, 64, 128
    q = torch.randn(s_q, h, d, device="cuda").to(torch.float8_e4m3fn)
    kv = torch.randn(s_kv, d, device="cuda").to(torch.float8_e4m3fn)
    sc = torch.rand(s_kv, device="cuda")
    w = torch.rand(s_q, h, device="cuda")
    ks = torch.zeros(s_q, dtype=torch.int32, device="cuda")
    ke = (s_kv - s_q + 1 + torch.arange(s_q, device="cuda")).int()
    us = harness.median_us(lambda: flash_mla.fp8_mqa_logits(q, (kv, sc), w, ks, ke), quick)
    pairs = float((ke - ks).sum())
    tflops = 2 * h * d * pairs / (us * 1e-6) / 1e12
    return dict(kind="prefill_logits", s_q=s_q, s_kv=s_kv, h=h, d=d, us=us, tflops=tflops, pct_peak=100 * tflops / peak)


def bench_topk(quick: bool, copy_gbs: float) -> dict:
    rows, n, k = 256, 32768, 2048
    x = torch.randn(rows, n, device="cuda")
    us = harness.median_us(lambda: flash_mla.topk_indices(x, k), quick)
    us_torch = harness.median_us(lambda: torch.topk(x, k, dim=1), quick)
    # the fused variant (decode rows: b=128 x next_n=2, cache slots through a 64-token-page table)
    table = torch.randperm(rows // 2 * (n // 64), device="cuda").view(rows // 2, n // 64).int()
    us_kv = harness.median_us(lambda: flash_mla.topk_kvcache_indices(x, k, table, 64, 2), quick)
    # CUDA-graph replay (as a decode step runs it: no host time between the kernels), both ops
    us_graph = harness.graph_replay_us(lambda i: lambda: flash_mla.topk_indices(x, k), 1, quick)
    us_torch_graph = harness.graph_replay_us(lambda i: lambda: torch.topk(x, k, dim=1), 1, quick)
    # the same sets in no set order (our final sort left out; torch.topk's sorted=False)
    us_unsorted = harness.median_us(lambda: flash_mla.topk_indices(x, k, sorted=False), quick)
    us_torch_unsorted = harness.median_us(lambda: torch.topk(x, k, dim=1, sorted=False), quick)
    us_kv_unsorted = harness.median_us(lambda: flash_mla.topk_kvcache_indices(x, k, table, 64, 2, sorted=False), quick)
    us_unsorted_graph = harness.graph_replay_us(lambda i: lambda: flash_mla.topk_indices(x, k, sorted=False), 1, quick)
    us_torch_unsorted_graph = harness.graph_replay_us(lambda i: lambda: torch.topk(x, k, dim=1, sorted=False), 1, quick)
    read_us = rows * n * 4 / (copy_gbs * 1e9) * 1e6
    return dict(
        kind="topk",
        rows=rows,
        n=n,
        k=k,
        us=us,
        us_torch_topk=us_torch,
        us_kvcache_indices=us_kv,
        us_graph=us_graph,
        us_torch_topk_graph=us_torch_graph,
        us_unsorted=us_unsorted,
        us_torch_topk_unsorted=us_torch_unsorted,
        us_kvcache_indices_unsorted=us_kv_unsorted,
        us_unsorted_graph=us_unsorted_graph,
        us_torch_topk_unsorted_graph=us_torch_unsorted_graph,
        read_us=read_us,
        x_read=us / read_us,
        x_torch=us / us_torch,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not harness.has_cuda("benchmarks.indexer"):
        return 2
    bf16_tflops, copy_gbs = harness.ceilings()
    fp8 = fp8_peak_tflops()
    peak = fp8 or bf16_tflops
    print(
        f"# ceilings: device copy {copy_gbs:.0f} GB/s, FP8 matmul {fp8 or float('nan'):.0f} TFLOP/s, bf16 {bf16_tflops:.0f}"
    )
    rows: list[dict] = []
    path = None
    # each row is printed and the results file rewritten as soon as it is measured, so that a run
    # cut short by a time limit keeps what it measured
    for bench in (lambda: bench_paged(args.quick, copy_gbs), lambda: bench_prefill(args.quick, peak),
                  lambda: bench_topk(args.quick, copy_gbs)):  # fmt: skip
        rows.append(bench())
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        path = harness.write_results(
            "indexer",
            dict(copy_gbs=copy_gbs, fp8_tflops=fp8, bf16_tflops=bf16_tflops, quick=args.quick, rows=rows),
            args.json if path is None else path,
        )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
