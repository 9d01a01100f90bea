"""Sparse decode benchmark at DeepSeek-V3.2 production shapes (docs/design.md §7).

For each shape (:data:`benchmarks.harness.DECODE_SHAPES`): a paged FP8 cache of ``b`` requests
with 32K-token contexts, random top-k positions per query token, index sets rotated between calls
so the touched cache bytes exceed L2; the median of ``triton.testing.do_bench`` for an eager call
and for CUDA-graph replay. Prints µs, TFLOP/s, GB/s, their share of the measured bf16-matmul and
device-copy ceilings, the backend that ran (the dispatcher's choice, or each ``--backends``
entry), and the ratio to FlashMLA's time on the same H200. Results: JSON under benchmarks/results/.

FLOPs = 2·b·s_q·h_q·topk·(d_qk + d_v); bytes = distinct cache tokens · bytes_per_token + q + out + lse.

    python -m benchmarks.decode [--quick] [--only b=128,h_q=128] [--backends auto,portable] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys

import torch

import sparse_mla as flash_mla

from . import harness
from .harness import DecodeShape


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--only", help="shape filters k=v,k=v (all must match); several separated by ';'")
    ap.add_argument("--backends", default="auto", help="comma list of backends to time on every shape it serves")
    ap.add_argument("--json", help="write the results here (default: benchmarks/results/<date>_<gpu>_decode.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.decode: needs a CUDA device", file=sys.stderr)
        return 2
    peak_tflops, peak_gbs = harness.ceilings()
    print(
        f"# {torch.cuda.get_device_name()}: measured ceilings bf16 matmul {peak_tflops:.0f} TFLOP/s, "
        f"device copy {peak_gbs:.0f} GB/s"
    )
    rows = []
    for s in harness.select(harness.DECODE_SHAPES, args.only):
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
    print_table(rows)
    path = harness.write_results(
        "decode", dict(peak_tflops=peak_tflops, peak_gbs=peak_gbs, quick=args.quick, rows=rows), args.json
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
