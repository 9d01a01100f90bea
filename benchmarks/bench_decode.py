"""Sparse decode benchmark at DeepSeek-V3.2 production shapes (issue 3/4; DESIGN §7).

For each shape: a paged FP8 cache of ``b`` requests with 32K-token contexts (page_block_size
64), random top-k positions per query token, several index sets rotated between calls so the
touched cache bytes exceed L2, timed with ``triton.testing.do_bench`` (median). Prints µs,
TFLOP/s, GB/s and their share of the measured bf16-matmul and device-copy ceilings, next to
FlashMLA's measured time on the same H200 (DESIGN §7).

FLOPs = 2·b·s_q·h_q·topk·(d_qk + d_v); bytes = unique cache tokens · bytes_per_token + q + out + lse.

    python benchmarks/bench_decode.py [--quick] [--json out.json] [--only b=128,h_q=128]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import sparse_mla as flash_mla  # noqa: E402
from sparse_mla import get_layout  # noqa: E402

# (b, h_q, s_q, topk, d_qk, FlashMLA µs on the lent H200 or None)
SHAPES = [
    (128, 128, 2, 2048, 576, 366.5),
    (64, 128, 2, 2048, 576, 188.2),
    (2, 128, 2, 2048, 576, 25.6),
    (1, 128, 1, 2048, 576, 21.7),
    (128, 64, 2, 2048, 576, 229.0),
    (148, 128, 2, 16384, 576, 3133.0),
    (128, 32, 2, 2048, 576, None),
    (128, 16, 2, 2048, 576, None),
    (64, 128, 2, 2048, 512, None),
    (64, 64, 2, 2048, 512, None),
]
CTX = 32768
PBS = 64


def ceilings() -> tuple[float, float]:
    """Measured bf16 matmul TFLOP/s and device-copy GB/s (read + write)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    bm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: a @ bm, warmup=100, rep=500, return_mode="median")
    tflops = 2 * 8192**3 / (t * 1e-3) / 1e12
    x = torch.empty(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    gbs = 2 * x.numel() * 2 / (t * 1e-3) / 1e9
    del a, bm, x, y
    return tflops, gbs


def make_inputs(b, h_q, s_q, topk, d_qk, n_sets, seed=0):
    lay = get_layout(d_qk)
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk_per = CTX // PBS
    total_blocks = b * nblk_per
    # the cache bytes directly (random latent values quantised would take long at 5M tokens):
    # quantise a pool of distinct tokens and tile it, so every slot holds a valid record
    pool_tokens = 65536
    k = torch.randn(pool_tokens // PBS, PBS, 1, d_qk, device="cuda", generator=g).to(torch.bfloat16)
    pool = flash_mla.quantize_k_cache(k, lay).view(torch.uint8)
    kc = torch.empty(total_blocks, PBS, 1, lay.bytes_per_token, dtype=torch.uint8, device="cuda")
    if lay.name == "MODEL1":
        kc = torch.empty(total_blocks, lay.block_bytes(PBS), dtype=torch.uint8, device="cuda")
        src = pool.as_strided((pool.shape[0], lay.block_bytes(PBS)), (lay.block_bytes(PBS), 1))
        for s in range(0, total_blocks, src.shape[0]):
            n = min(src.shape[0], total_blocks - s)
            kc[s : s + n] = src[:n]
        kc = kc.as_strided((total_blocks, PBS, 1, lay.bytes_per_token), (lay.block_bytes(PBS), lay.bytes_per_token, lay.bytes_per_token, 1))
    else:
        for s in range(0, total_blocks, pool.shape[0]):
            n = min(pool.shape[0], total_blocks - s)
            kc[s : s + n] = pool[:n]
    block_table = torch.randperm(total_blocks, device="cuda", generator=g).view(b, nblk_per).int()
    q = torch.randn(b, s_q, h_q, d_qk, device="cuda", generator=g).to(torch.bfloat16)
    sets = []
    for _ in range(n_sets):
        pos = torch.rand(b * s_q, CTX, device="cuda", generator=g).argsort(dim=1)[:, :topk].view(b, s_q, topk).int()
        sets.append(flash_mla.abs_indices_to_kvcache_indices(pos, block_table, PBS))
    return q, kc, sets, lay


def bench_shape(b, h_q, s_q, topk, d_qk, peak_tflops, peak_gbs, quick=False):
    lay = get_layout(d_qk)
    per_call_bytes = b * s_q * topk * lay.bytes_per_token
    n_sets = max(2, min(16, int(4 * 60e6 // per_call_bytes) + 1))  # >= ~4x L2 touched in rotation
    q, kc, sets, lay = make_inputs(b, h_q, s_q, topk, d_qk, n_sets)
    meta, _ = flash_mla.get_mla_metadata()
    state = {"i": 0}

    def fn():
        idx = sets[state["i"] % n_sets]
        state["i"] += 1
        return flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)

    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25 if quick else 100, rep=100 if quick else 500, return_mode="median")
    us = ms * 1e3
    # as an engine runs decode: one CUDA graph per index set, replayed in rotation (no host overhead)
    graphs = []
    for i in range(n_sets):
        g = torch.cuda.CUDAGraph()
        state["i"] = i
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    gstate = {"i": 0}

    def replay():
        graphs[gstate["i"] % n_sets].replay()
        gstate["i"] += 1

    replay()
    torch.cuda.synchronize()
    us_graph = 1e3 * triton.testing.do_bench(replay, warmup=25 if quick else 100, rep=100 if quick else 500, return_mode="median")
    us = min(us, us_graph)
    flops = 2 * b * s_q * h_q * topk * (d_qk + 512)
    uniq = sum(int(torch.unique(s[s >= 0]).numel()) for s in sets) / n_sets
    nbytes = uniq * lay.bytes_per_token + q.numel() * 2 + b * s_q * h_q * 512 * 2 + b * s_q * h_q * 4
    tflops = flops / (us * 1e-6) / 1e12
    gbs = nbytes / (us * 1e-6) / 1e9
    del q, kc, sets, graphs
    torch.cuda.empty_cache()
    return dict(
        b=b, h_q=h_q, s_q=s_q, topk=topk, d_qk=d_qk, us=us, us_eager=ms * 1e3, us_graph=us_graph, tflops=tflops, gbs=gbs,
        pct_mma=100 * tflops / peak_tflops, pct_hbm=100 * gbs / peak_gbs, num_sm_parts=meta.table.num_sm_parts,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", help="comma list of b=..,h_q=..,d_qk=.. filters (all must match)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    flt = dict(kv.split("=") for kv in args.only.split(",")) if args.only else {}
    peak_tflops, peak_gbs = ceilings()
    dev = torch.cuda.get_device_name()
    print(f"# {dev}: measured ceilings bf16 matmul {peak_tflops:.0f} TFLOP/s, device copy {peak_gbs:.0f} GB/s")
    rows = []
    for b, h_q, s_q, topk, d_qk, fm_us in SHAPES:
        cfg = dict(b=b, h_q=h_q, s_q=s_q, topk=topk, d_qk=d_qk)
        if any(str(cfg.get(k)) != v for k, v in flt.items()):
            continue
        r = bench_shape(b, h_q, s_q, topk, d_qk, peak_tflops, peak_gbs, args.quick)
        r["flashmla_us"] = fm_us
        rows.append(r)
        print(f"  done b={b} h_q={h_q} s_q={s_q} topk={topk} d_qk={d_qk}: {r['us']:.1f} us", flush=True)
    print("us = min(eager call, CUDA-graph replay); eager includes Python launch overhead")
    hdr = f"{'b':>4} {'h_q':>4} {'s_q':>3} {'topk':>6} {'d_qk':>4} {'eager us':>9} {'graph us':>9} {'us':>9} {'TFLOP/s':>8} {'GB/s':>7} {'%mma':>5} {'%hbm':>5} {'FlashMLA us':>11} {'ratio':>6}"
    print(hdr)
    for r in rows:
        fm = r["flashmla_us"]
        print(
            f"{r['b']:>4} {r['h_q']:>4} {r['s_q']:>3} {r['topk']:>6} {r['d_qk']:>4} {r['us_eager']:>9.1f} {r['us_graph']:>9.1f} {r['us']:>9.1f} {r['tflops']:>8.1f} "
            f"{r['gbs']:>7.0f} {r['pct_mma']:>5.1f} {r['pct_hbm']:>5.1f} {fm if fm else '-':>11} "
            f"{(r['us'] / fm) if fm else float('nan'):>6.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev, peak_tflops=peak_tflops, peak_gbs=peak_gbs, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
