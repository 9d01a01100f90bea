"""Launch-parameter sweep of the indexer kernels on the benchmark shapes (one GPU run picks the
defaults in ``sparse_mla.indexer.kernels``: ``PAGED_CONFIG``, ``PREFILL_CONFIG``, ``TOPK_CONFIG``;
each config is passed to the launcher as ``config``, the fields it changes).

Each config's result is checked against the default config's (same logits bits up to fp32
summation order: max |diff| printed; the top-k must be identical), then timed; configs that fail
to compile or run are reported and skipped.

    python -m benchmarks.indexer_sweep [--quick] [--only paged|prefill|topk] [--match TEXT] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

import sparse_mla as flash_mla
from sparse_mla.indexer import kernels as K

from . import harness
from .indexer import bench_paged, bench_prefill


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("inf")
    return float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0


def _run(label: str, fn, check, quick: bool, rows: list, **info) -> None:
    try:
        fn()
        torch.cuda.synchronize()
        err = check()
        us = harness.median_us(fn, quick)
    except Exception as e:  # noqa: BLE001 (a config that does not compile or fit: report, go on)
        print(f"{label:70s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
        return
    rows.append(dict(label=label, us=us, err=err, **info))
    print(f"{label:70s} {us:9.1f} us  max|diff| {err:.3g}", flush=True)


def sweep_paged(quick: bool, rows: list, pointer_grid: bool = True) -> None:
    """The pointer path's launch grid (``pointer_grid``), then the tensor-memory path's (sm_90+),
    each config checked against the pointer path's default."""
    b, next_n, h, d, blk, ctx_len = 128, 2, 64, 128, 64, 32768
    nblk = ctx_len // blk
    cache = torch.randint(0, 255, (b * nblk, blk, 1, d + 4), dtype=torch.uint8, device="cuda")
    cache.view(b * nblk, -1)[:, blk * d :].view(torch.float32).fill_(0.01)
    cache.view(b * nblk, -1)[:, : blk * d][cache.view(b * nblk, -1)[:, : blk * d] & 0x7F == 0x7F] = 0  # no NaN
    table = torch.randperm(b * nblk, device="cuda").view(b, nblk).int()
    q = torch.randn(b, next_n, h, d, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8)
    w = torch.rand(b * next_n, h, device="cuda")
    ctx = torch.full((b,), ctx_len, dtype=torch.int32, device="cuda")
    ref = torch.empty(b * next_n, ctx_len, device="cuda")
    K.launch_paged_mqa_logits(q, cache, w, ctx, table, ref, ctx_len, config=dict(tma=False))
    out = torch.empty_like(ref)
    configs = []
    if pointer_grid:
        configs += [
            dict(tma=False, block_n=block_n, num_warps=warps, num_stages=stages, progs_per_sm=pps)
            for block_n, warps, stages, pps in itertools.product((64, 128), (4, 8), (2, 3, 4, 5), (4, 8, 16, 32))
        ]
    if K.tma_supported(cache.device):
        configs += [
            dict(tma=True, tma_stages=stages, tma_maxnreg=reg, tma_progs_per_sm=pps, num_warps=warps)
            for stages, reg, pps, warps in itertools.product((6, 8), (0, 128, 168), (6, 8, 12), (4,))
        ]
    for cfg in configs:
        _run(
            f"paged {cfg}",
            lambda cfg=cfg: K.launch_paged_mqa_logits(q, cache, w, ctx, table, out, ctx_len, config=cfg),
            lambda: _diff(out, ref),
            quick,
            rows,
            kind="paged",
            config=cfg,
        )


def sweep_prefill(quick: bool, rows: list) -> None:
    s_q, s_kv, h, d = 4096, 32768, 64, 128
    q = torch.randn(s_q, h, d, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8)
    kv = torch.randn(s_kv, d, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8)
    sc = torch.rand(s_kv, device="cuda")
    w = torch.rand(s_q, h, device="cuda")
    ks = torch.zeros(s_q, dtype=torch.int32, device="cuda")
    ke = (s_kv - s_q + 1 + torch.arange(s_q, device="cuda")).int()
    ref = torch.empty(s_q, s_kv, device="cuda")
    K.launch_mqa_logits(q, kv, sc, w, ks, ke, ref)
    out = torch.empty_like(ref)
    grid = itertools.product((64, 128), (64, 128, 256), (4, 8), (2, 3, 4))
    for block_n, r, warps, stages in grid:
        cfg = dict(block_n=block_n, rows=r, num_warps=warps, num_stages=stages)
        _run(
            f"prefill {cfg}",
            lambda cfg=cfg: K.launch_mqa_logits(q, kv, sc, w, ks, ke, out, config=cfg),
            lambda: _diff(out, ref),
            quick,
            rows,
            kind="prefill",
            config=cfg,
        )


def sweep_topk(quick: bool, rows: list, match: str | None = None) -> None:
    """The top-k configs below on 256 rows of 32K, k 2048 (``match``: only those whose text contains
    it, after the default config as the baseline of the same run)."""
    n_rows, n, k = 256, 32768, 2048
    x = torch.randn(n_rows, n, device="cuda")
    lo = torch.zeros(n_rows, dtype=torch.int64, device="cuda")
    hi = torch.full((n_rows,), n, dtype=torch.int64, device="cuda")
    ref = flash_mla.topk_indices(x, k)
    out = torch.empty(n_rows, k, dtype=torch.int32, device="cuda")
    # the register path (rows of up to `bisect` entries: the k-th key's top bits, a list, the rest on
    # it), by warps and list capacity
    configs = [dict(bisect=32768, split=0, bisect_warps=w) for w in (8, 16, 32)]
    configs += [dict(bisect=32768, split=0, bisect_cap=c) for c in (1, 4)]
    # the split path (the default for rows of 8192 to 32768 entries), by chunk and list warps
    configs += [dict(split_chunk=c, split_warps=w) for c, w in ((2048, 4), (4096, 8), (8192, 8))]
    configs += [dict(split_list_warps=w) for w in (8, 16)]
    # the radix select (longer rows; here forced with bisect 0): histograms and split over (rows,
    # segments) programs, then the candidate list
    configs += [
        dict(block=2048, num_warps=4, programs_per_sm=pps, split_block=sb, bisect=0)
        for pps, sb in [(8, 2048), (4, 2048), (4, 1024)]
    ]
    configs += [
        dict(block=2048, num_warps=4, programs_per_sm=pps, final_warps=fw, bisect=0)
        for pps, fw in [(8, 8), (4, 8), (8, 2)]
    ]  # fmt: skip
    if match:  # (alternatives separated by '|')
        configs = [{}] + [c for c in configs if any(m in str(c) for m in match.split("|"))]
    for cfg, kk in itertools.product(configs, (k,)):

        def check(cfg=cfg, kk=kk):
            K.launch_topk(x, lo, hi, out, kk, kk, config=cfg)
            return 0.0 if torch.equal(out[:, :kk], ref[:, :kk]) else float("inf")

        _run(
            f"topk k={kk} {cfg}",
            lambda cfg=cfg, kk=kk: K.launch_topk(x, lo, hi, out, kk, kk, config=cfg),
            check,
            quick,
            rows,
            kind=f"topk k={kk}",
            config=cfg,
        )
    us_sort = harness.median_us(lambda: torch.sort(ref.long(), dim=1, descending=True), quick)
    print(f"{'(a torch.sort of [256, 2048] int64, for scale)':70s} {us_sort:9.1f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--only", choices=("paged", "paged_tma", "prefill", "topk"), help="paged_tma: the tensor-memory grid only"
    )
    ap.add_argument("--match", help="topk: only the configs whose text contains this ('a|b': either; and the default)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not harness.has_cuda("benchmarks.indexer_sweep"):
        return 2
    print(f"# defaults: paged {K.PAGED_CONFIG}, prefill {K.PREFILL_CONFIG}, topk {K.TOPK_CONFIG}")
    rows: list = []
    copy_gbs = harness.copy_ceiling_gbs()
    if args.only in (None, "paged", "paged_tma"):
        print(bench_paged(args.quick, copy_gbs))
        sweep_paged(args.quick, rows, pointer_grid=args.only != "paged_tma")
    if args.only in (None, "prefill"):
        print(bench_prefill(args.quick, 1.0))
        sweep_prefill(args.quick, rows)
    if args.only in (None, "topk"):
        sweep_topk(args.quick, rows, args.match)
    for kind in ("paged", "prefill", "topk k=2048"):
        best = sorted((r for r in rows if r["kind"] == kind and r["err"] < float("inf")), key=lambda r: r["us"])[:3]
        for r in best:
            print(f"best {kind}: {r['us']:.1f} us {r['config']}")
    path = harness.write_results("indexer_sweep", dict(copy_gbs=copy_gbs, quick=args.quick, rows=rows), args.json)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
