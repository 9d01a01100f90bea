"""Sparse decode benchmark at DeepSeek-V3.2 production shapes (docs/design.md §7).

For each shape of the selected set (``--set``, :data:`benchmarks.harness.SHAPE_SETS`): a paged FP8
cache of ``b`` requests with 32K-token contexts, random top-k positions per query token, index sets
rotated between calls so the touched cache bytes exceed L2; the median of ``triton.testing.do_bench``
for an eager call and for CUDA-graph replay. Prints µs, TFLOP/s, GB/s, their share of the measured
bf16-matmul and device-copy ceilings, the backend that ran (the dispatcher's choice, or each
``--backends`` entry), and the ratio to FlashMLA's time on the same H200. Results: JSON under
benchmarks/results/.

Sets: ``default`` (:data:`~benchmarks.harness.DECODE_SHAPES`, the production shapes) and
``small_heads`` (:data:`~benchmarks.harness.SMALL_HEAD_SHAPES`, the small-head table: h_q 8/16/32/64
by b 2/64/128, and MODEL1 at h_q 16/32). FlashMLA has no sparse decode kernel below 64 heads, so an
engine pads a small slice to 64: the small_heads table compares with FlashMLA's time at h_q = 64,
and says so in its header.

FLOPs = 2·b·s_q·h_q·topk·(d_qk + d_v). Bytes: the *unique gathered cache bytes* = distinct cache
tokens the call's indices read (main and extra cache, each token once however many query tokens,
heads or requests use it; nothing past ``topk_length``/``extra_topk_length``) × bytes per token
(656 V32, 584 MODEL1, scales included). ``cache GB/s`` and ``%copy`` (of the measured device-copy
GB/s) count those bytes only; the default table's ``GB/s``/``%hbm`` add q, out and lse to them
(as in the stored results). JSON rows hold both (``cache_gbs``/``pct_copy``, ``gbs``/``pct_hbm``).

    python -m benchmarks.decode [--quick] [--set small_heads] [--only b=128,h_q=16] [--backends auto,portable]
                                [--json PATH] [--list]
"""

from __future__ import annotations

import argparse
import sys

import torch

import sparse_mla as flash_mla

from . import harness
from .harness import DecodeShape
from .variants import set_hopper_default


def bench_shape(s: DecodeShape, backend: str, peak_tflops: float, peak_gbs: float, quick: bool) -> dict:
    inp = harness.decode_inputs(s)
    n_sets = len(inp.index_sets)
    meta, _ = flash_mla.get_mla_metadata()

    def call_with(i: int):
        kw = inp.call_kwargs(i)
        return lambda: flash_mla.flash_mla_with_kvcache(
            inp.q, inp.k_cache, None, None, 512, meta, is_fp8_kvcache=True, backend=backend, **kw
        )

    state = {"i": 0}

    def rotating():
        state["i"] += 1
        return call_with(state["i"])()

    rotating()
    torch.cuda.synchronize()
    us_eager = harness.median_us(rotating, quick)
    us_graph = harness.graph_replay_us(call_with, n_sets, quick)
    us = min(us_eager, us_graph)
    tflops = harness.decode_flops(s, inp.extra_attended()) / (us * 1e-6) / 1e12
    gbs = inp.bytes_moved(s) / (us * 1e-6) / 1e9
    cache_gbs = inp.cache_bytes(s) / (us * 1e-6) / 1e9
    row = dict(
        harness.as_dict(s),
        backend=meta.backend,
        us=us,
        us_eager=us_eager,
        us_graph=us_graph,
        tflops=tflops,
        gbs=gbs,
        pct_mma=100 * tflops / peak_tflops,
        pct_hbm=100 * gbs / peak_gbs,
        cache_bytes=inp.cache_bytes(s),
        cache_gbs=cache_gbs,
        pct_copy=100 * cache_gbs / peak_gbs,
        num_sm_parts=meta.table.num_sm_parts,
        ratio_to_flashmla=(us / s.flashmla_us) if s.flashmla_us else None,
    )
    return row


def _extra(r: dict) -> str:
    """``+1024/p64`` (extra top-k / its page size, ``L``: with extra_topk_length), ``len`` for a
    full topk_length, ``-`` for neither."""
    text = "len " if r.get("topk_len") else ""
    if r.get("extra_topk"):
        text += f"+{r['extra_topk']}/p{r['extra_pbs']}" + ("L" if r.get("extra_len") else "")
    return text.strip() or "-"


def print_table(rows: list[dict]) -> None:
    print("us = min(eager call, CUDA-graph replay); eager includes Python launch overhead")
    print(
        f"{'b':>4} {'h_q':>4} {'s_q':>3} {'topk':>6} {'d_qk':>4} {'extra':>10} {'backend':>9} {'eager us':>9} {'graph us':>9} "
        f"{'us':>9} {'TFLOP/s':>8} {'GB/s':>7} {'%mma':>5} {'%hbm':>5} {'FlashMLA us':>11} {'ratio':>6}"
    )
    for r in rows:
        fm, ratio = r["flashmla_us"], r["ratio_to_flashmla"]
        print(
            f"{r['b']:>4} {r['h_q']:>4} {r['s_q']:>3} {r['topk']:>6} {r['d_qk']:>4} {_extra(r):>10} {r['backend']:>9} "
            f"{r['us_eager']:>9.1f} {r['us_graph']:>9.1f} {r['us']:>9.1f} {r['tflops']:>8.1f} {r['gbs']:>7.0f} "
            f"{r['pct_mma']:>5.1f} {r['pct_hbm']:>5.1f} {fm if fm else '-':>11} {f'{ratio:.2f}' if ratio else '-':>6}"
        )


def print_small_heads_table(rows: list[dict]) -> None:
    """The small-head table: µs, GB/s on the unique gathered cache bytes and their share of the
    device copy, and FlashMLA's time at 64 heads (what a slice of fewer heads pays padded to 64)."""
    print("us = min(eager call, CUDA-graph replay); eager includes Python launch overhead")
    print("cache GB/s = unique gathered cache bytes (distinct tokens x bytes/token) / us; %copy = its share of the")
    print("measured device-copy GB/s. FlashMLA has no kernel below 64 heads: engines pad h_q to 64, so the FlashMLA")
    print("column is FlashMLA 1.0 at h_q = 64, same b/s_q/topk/cache, same H200 ('-': not measured)")
    print(
        f"{'b':>4} {'h_q':>4} {'s_q':>3} {'topk':>6} {'d_qk':>4} {'extra':>10} {'backend':>9} {'us':>9} "
        f"{'cache MB':>9} {'cache GB/s':>10} {'%copy':>5} {'FlashMLA us (padded to 64 heads)':>33} {'ratio':>6}"
    )
    for r in rows:
        fm, ratio = r["flashmla_us"], r["ratio_to_flashmla"]
        fm_text = (
            "-"
            if not fm
            else f"{fm:.1f}" + (f" (h_q {r['h_q']} -> {r['flashmla_heads']})" if r.get("flashmla_heads") else "")
        )
        print(
            f"{r['b']:>4} {r['h_q']:>4} {r['s_q']:>3} {r['topk']:>6} {r['d_qk']:>4} {_extra(r):>10} {r['backend']:>9} "
            f"{r['us']:>9.1f} {r['cache_bytes'] / 1e6:>9.1f} {r['cache_gbs']:>10.0f} {r['pct_copy']:>5.1f} "
            f"{fm_text:>33} {f'{ratio:.2f}' if ratio else '-':>6}"
        )


def list_shapes(shapes: list[DecodeShape]) -> None:
    """The rows a run would time (no device needed)."""
    print(
        f"{'b':>4} {'h_q':>4} {'s_q':>3} {'topk':>6} {'d_qk':>4} {'ctx':>6} {'pbs':>4} {'extra':>10} {'FlashMLA us':>11}"
    )
    for s in shapes:
        r = harness.as_dict(s)
        fm = "-" if s.flashmla_us is None else f"{s.flashmla_us:.1f}"
        if s.flashmla_heads:
            fm += f" (at h_q {s.flashmla_heads}: padded)"
        print(f"{s.b:>4} {s.h_q:>4} {s.s_q:>3} {s.topk:>6} {s.d_qk:>4} {s.ctx:>6} {s.pbs:>4} {_extra(r):>10} {fm:<11}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument(
        "--set",
        default="default",
        choices=sorted(harness.SHAPE_SETS),
        help="row set: the production shapes (default) or the small head counts of tensor-parallel slices (small_heads)",
    )
    ap.add_argument("--list", action="store_true", help="print the selected rows and exit (no device needed)")
    ap.add_argument("--only", help="shape filters k=v,k=v (all must match); several separated by ';'")
    ap.add_argument("--backends", default="auto", help="comma list of backends to time on every shape it serves")
    ap.add_argument(
        "--json",
        help="write the results here (default: benchmarks/results/<date>_<gpu>_decode.json, "
        "_decode_small_heads.json for --set small_heads)",
    )
    ap.add_argument(
        "--hopper-config",
        default="",
        help="KEY=V,... HopperConfig fields made the Hopper kernel's default (e.g. half_stages=0); "
        "default: the library's",
    )
    args = ap.parse_args(argv)
    set_hopper_default(args.hopper_config)
    shapes = harness.select(harness.SHAPE_SETS[args.set], args.only)
    if args.list:
        list_shapes(shapes)
        return 0
    if not harness.has_cuda("benchmarks.decode"):
        return 2
    peak_tflops, peak_gbs = harness.ceilings()
    print(
        f"# {torch.cuda.get_device_name()}: measured ceilings bf16 matmul {peak_tflops:.0f} TFLOP/s, "
        f"device copy {peak_gbs:.0f} GB/s"
    )
    rows = []
    for s in shapes:
        for backend in args.backends.split(","):
            try:
                r = bench_shape(s, backend, peak_tflops, peak_gbs, args.quick)
                torch.cuda.empty_cache()
            except ValueError as e:  # this backend cannot serve the shape (the message says why)
                print(f"  skip {s} on {backend}: {e}", flush=True)
                continue
            rows.append(r)
            print(
                f"  done b={s.b} h_q={s.h_q} s_q={s.s_q} topk={s.topk} d_qk={s.d_qk} [{r['backend']}]: {r['us']:.1f} us",
                flush=True,
            )
    (print_table if args.set == "default" else print_small_heads_table)(rows)
    path = harness.write_results(
        "decode" if args.set == "default" else f"decode_{args.set}",
        dict(peak_tflops=peak_tflops, peak_gbs=peak_gbs, quick=args.quick, set=args.set, rows=rows),
        args.json,
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
