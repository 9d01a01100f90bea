"""Fused quantise-and-store benchmark (``sparse_mla.kvcache.kernels.store``): GB/s against the HBM ceiling.

For each layout, token count ``n`` (decode batches up to prefill chunks), slot pattern (``random``:
distinct random slots of a pool twice the size, like a decode step over many requests;
``contiguous``: consecutive slots, like a prefill) and ``block_t`` (tokens per program), the kernel
is timed with ``triton.testing.do_bench`` (median) and compared with the measured device-copy
bandwidth (read + write of a 2 GiB buffer) and, at one size, with the PyTorch twin.

bytes moved = n·d_qk·2 (bf16 read) + n·bytes_per_token (cache write) + n·8 (slots).

    python -m benchmarks.store [--quick] [--json PATH]   (default: benchmarks/results/<date>_<gpu>_store.json)
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from sparse_mla import get_layout, quantize_and_store_kv
from sparse_mla.reference import quantize_and_store_kv_reference

from . import harness
from .harness import PBS


def make(layout: str, n: int, pattern: str, seed: int = 0):
    lay = get_layout(layout)
    nb = max(2 * n // PBS + 1, 4)
    bb = lay.block_bytes(PBS)
    buf = torch.zeros(nb * bb, dtype=torch.uint8, device="cuda")
    if lay.name == "V32":
        kc = buf.view(nb, PBS, 1, lay.bytes_per_token)
    else:
        kc = buf.as_strided((nb, PBS, 1, lay.bytes_per_token), (bb, lay.bytes_per_token, lay.bytes_per_token, 1))
    kc = kc.view(torch.float8_e4m3fn)
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = (torch.randn(n, lay.d_qk, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    if pattern == "random":
        slots = torch.randperm(nb * PBS, device="cuda", generator=g)[:n]
    else:
        slots = torch.arange(n, device="cuda", dtype=torch.int64) + PBS
    return lay, kc, kv, slots


def bench(layout: str, n: int, pattern: str, block_t: int, ceiling: float, quick: bool) -> dict:
    lay, kc, kv, slots = make(layout, n, pattern)

    def fn():
        quantize_and_store_kv(kv, slots, kc, block_t=block_t)

    fn()
    torch.cuda.synchronize()
    us = harness.median_us(fn, quick)
    nbytes = n * lay.d_qk * 2 + n * lay.bytes_per_token + n * 8
    gbs = nbytes / (us * 1e-6) / 1e9
    return dict(layout=layout, n=n, pattern=pattern, block_t=block_t, us=us, gbs=gbs, pct_hbm=100 * gbs / ceiling)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if not harness.has_cuda("benchmarks.store"):
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    ceiling = harness.copy_ceiling_gbs()
    print(f"device copy ceiling: {ceiling:.0f} GB/s (read + write)")
    sizes = [64, 4096, 65536] if args.quick else [64, 512, 4096, 32768, 131072, 524288]
    block_ts = [1, 4] if args.quick else [1, 2, 4, 8]
    rows = []
    hdr = f"{'layout':7} {'n':>7} {'slots':10} {'block_t':>7} {'µs':>9} {'GB/s':>8} {'% copy':>7}"
    print(hdr)
    print("-" * len(hdr))
    for layout in ("V32", "MODEL1"):
        for n in sizes:
            for pattern in ("random", "contiguous"):
                for bt in block_ts:
                    r = bench(layout, n, pattern, bt, ceiling, args.quick)
                    rows.append(r)
                    print(f"{layout:7} {n:7d} {pattern:10} {bt:7d} {r['us']:9.2f} {r['gbs']:8.1f} {r['pct_hbm']:6.1f}%")
                torch.cuda.empty_cache()
    # best block_t per (layout, n, pattern), and the default's choice
    print("\nbest block_t per shape:")
    for layout in ("V32", "MODEL1"):
        for n in sizes:
            for pattern in ("random", "contiguous"):
                cand = [r for r in rows if r["layout"] == layout and r["n"] == n and r["pattern"] == pattern]
                best = max(cand, key=lambda r: r["gbs"])
                dflt = 1 if n < 1024 else 4
                d = next((r for r in cand if r["block_t"] == dflt), None)
                dtxt = f"default block_t={dflt}: {d['gbs']:.0f} GB/s" if d else ""
                print(
                    f"  {layout:7} n={n:7d} {pattern:10} best block_t={best['block_t']} {best['gbs']:.0f} GB/s "
                    f"({best['pct_hbm']:.0f}% of copy)  {dtxt}"
                )
    # the PyTorch twin at one size, for scale
    n = 32768
    lay, kc, kv, slots = make("V32", n, "random")
    us_ref = harness.median_us(lambda: quantize_and_store_kv_reference(kv, slots, kc), quick=True)
    us_k = harness.median_us(lambda: quantize_and_store_kv(kv, slots, kc), quick=True)
    print(f"\nV32 n={n} random: Triton kernel {us_k:.1f} µs vs PyTorch twin {us_ref:.1f} µs ({us_ref / us_k:.1f}x)")
    path = harness.write_results(
        "store", dict(ceiling_gbs=ceiling, quick=args.quick, rows=rows, twin_us=us_ref, kernel_us=us_k), args.json
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
