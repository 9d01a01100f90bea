"""Fused quantise-and-store benchmark (``sparse_mla.serving.store``): GB/s against the HBM ceiling.

For each layout, token count ``n`` (decode batches up to prefill chunks), slot pattern (``random``:
distinct random slots of a pool twice the size, like a decode step over many requests;
``contiguous``: consecutive slots, like a prefill) and ``block_t`` (tokens per program), the kernel
is timed with ``triton.testing.do_bench`` (median) and compared with the measured device-copy
bandwidth (read + write of a 2 GiB buffer) and, at one size, with the PyTorch twin.

bytes moved = n·d_qk·2 (bf16 read) + n·bytes_per_token (cache write) + n·8 (slots).

    python benchmarks/bench_store.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from sparse_mla import get_layout, quantize_and_store_kv  # noqa: E402
from sparse_mla.reference import quantize_and_store_kv_reference  # noqa: E402

PBS = 64


def copy_ceiling_gbs() -> float:
    """Measured device-copy GB/s (read + write) of a 2 GiB buffer."""
    x = torch.empty(1024**3, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    gbs = 2 * x.numel() * 2 / (t * 1e-3) / 1e9
    del x, y
    torch.cuda.empty_cache()
    return gbs


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
    fn = lambda: quantize_and_store_kv(kv, slots, kc, block_t=block_t)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=10 if quick else 50, rep=50 if quick else 300, return_mode="median")
    nbytes = n * lay.d_qk * 2 + n * lay.bytes_per_token + n * 8
    gbs = nbytes / (ms * 1e-3) / 1e9
    return dict(layout=layout, n=n, pattern=pattern, block_t=block_t, us=ms * 1e3, gbs=gbs, pct_hbm=100 * gbs / ceiling)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_store.py needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    ceiling = copy_ceiling_gbs()
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
                print(f"  {layout:7} n={n:7d} {pattern:10} best block_t={best['block_t']} {best['gbs']:.0f} GB/s "
                      f"({best['pct_hbm']:.0f}% of copy)  {dtxt}")
    # the PyTorch twin at one size, for scale
    n = 32768
    lay, kc, kv, slots = make("V32", n, "random")
    ms_ref = triton.testing.do_bench(lambda: quantize_and_store_kv_reference(kv, slots, kc), warmup=5, rep=50,
                                     return_mode="median")
    ms_k = triton.testing.do_bench(lambda: quantize_and_store_kv(kv, slots, kc), warmup=10, rep=100, return_mode="median")
    print(f"\nV32 n={n} random: Triton kernel {ms_k * 1e3:.1f} µs vs PyTorch twin {ms_ref * 1e3:.1f} µs "
          f"({ms_ref / ms_k:.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ceiling_gbs=ceiling, rows=rows, twin_us=ms_ref * 1e3, kernel_us=ms_k * 1e3), f, indent=1)


if __name__ == "__main__":
    main()
