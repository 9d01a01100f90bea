"""Sparse prefill benchmark (``sparse_mla.flash_mla_sparse_fwd``) against FlashMLA's prefill on the
same GPU, for both ``kv`` forms: bf16 rows (FlashMLA's input) and the FP8 paged cache (ours only;
no up-converted copy).

Shapes: FlashMLA's prefill benchmark rows (``s_q = 4096``, attn_sink on, random top-k
rows of ``s_kv`` per query token), plus tensor-parallel head counts 16 and 32. Per row: µs (median
of ``triton.testing.do_bench``), TFLOP/s on ``2·s_q·h_q·topk·(d_qk + 512)``, % of the measured bf16
matmul ceiling, and the ratio to FlashMLA's bf16 time (targets: bf16 ≤ 1.10, FP8 cache ≤ 1.20).

    python -m benchmarks.prefill [--quick] [--only k=v,...] [--forms bf16,fp8] [--backend NAME] [--json PATH]
        [--hopper-config KEY=V,...]

``--backend`` (default ``auto``: the Hopper kernel on an sm_90 GPU for both forms) times another
backend, e.g. ``portable`` for the bf16 rows' previous path.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

import sparse_mla as flash_mla
from sparse_mla import get_layout

from . import harness
from .variants import set_hopper_default


@dataclass(frozen=True)
class PrefillShape:
    s_q: int
    h_q: int
    topk: int
    d_qk: int
    s_kv: int
    flashmla_us: float | None = None


PREFILL_SHAPES = [
    PrefillShape(4096, 128, 2048, 576, 8192, 3450.0),
    PrefillShape(4096, 128, 2048, 576, 32768, 3700.0),
    PrefillShape(4096, 128, 2048, 576, 65536, 4077.0),
    PrefillShape(4096, 128, 2048, 576, 131072, 4131.0),
    PrefillShape(4096, 64, 2048, 576, 32768, 1900.0),
    PrefillShape(4096, 32, 2048, 576, 32768),
    PrefillShape(4096, 16, 2048, 576, 32768),
    PrefillShape(4096, 64, 512, 512, 32768, 549.0),
    PrefillShape(4096, 128, 1024, 512, 32768, 1844.0),
]
PBS = 64


def prefill_flops(s: PrefillShape) -> int:
    return 2 * s.s_q * s.h_q * s.topk * (s.d_qk + 512)


def make_inputs(s: PrefillShape, seed: int = 0) -> dict:
    """q, the bf16 rows, their FP8 cache (page 64; slot = row) and random distinct top-k rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s.s_q, s.h_q, s.d_qk, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(s.s_kv, 1, s.d_qk, device="cuda", generator=g).to(torch.bfloat16)
    cache = flash_mla.quantize_k_cache(kv.view(s.s_kv // PBS, PBS, 1, s.d_qk), get_layout(s.d_qk))
    idx = torch.empty(s.s_q, 1, s.topk, dtype=torch.int32, device="cuda")
    for i in range(0, s.s_q, 256):  # distinct rows per query token, in chunks (s_kv up to 128K)
        n = min(256, s.s_q - i)
        idx[i : i + n, 0] = torch.rand(n, s.s_kv, device="cuda", generator=g).topk(s.topk, dim=1).indices.int()
    sink = torch.randn(s.h_q, device="cuda", generator=g)
    return dict(q=q, kv=kv, cache=cache, indices=idx, sink=sink)


def bench_shape(s: PrefillShape, form: str, peak_tflops: float, quick: bool, backend: str = "auto") -> dict:
    inp = make_inputs(s)
    kv = inp["kv"] if form == "bf16" else inp["cache"]

    def fn():
        return flash_mla.flash_mla_sparse_fwd(
            inp["q"], kv, inp["indices"], s.d_qk**-0.5, attn_sink=inp["sink"], backend=backend
        )

    fn()
    torch.cuda.synchronize()
    us = harness.median_us(fn, quick)
    tflops = prefill_flops(s) / (us * 1e-6) / 1e12
    return dict(
        harness.as_dict(s),
        form=form,
        backend=backend,
        us=us,
        tflops=tflops,
        pct_mma=100 * tflops / peak_tflops,
        ratio_to_flashmla=(us / s.flashmla_us) if s.flashmla_us else None,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", help="shape filters k=v,k=v; several separated by ';'")
    ap.add_argument("--forms", default="bf16,fp8", help="kv forms to time: bf16, fp8")
    ap.add_argument("--backend", default="auto", help="prefill backend: auto, hopper, portable")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--hopper-config",
        default="",
        help="KEY=V,... HopperConfig fields for the Hopper route (e.g. narrow_staged_out=1); default: the library's",
    )
    args = ap.parse_args(argv)
    set_hopper_default(args.hopper_config)
    if not harness.has_cuda("benchmarks.prefill"):
        return 2
    peak_tflops, _ = harness.ceilings()
    rows = []
    print(
        f"{'s_q':>5} {'h_q':>4} {'topk':>5} {'d_qk':>4} {'s_kv':>7} {'kv':>5} {'us':>9} {'TFLOP/s':>8} {'%mma':>5} {'FlashMLA':>9} {'ratio':>6}"
    )
    for s in harness.select(PREFILL_SHAPES, args.only):
        for form in args.forms.split(","):
            r = bench_shape(s, form, peak_tflops, args.quick, args.backend)
            rows.append(r)
            fm, ratio = s.flashmla_us, r["ratio_to_flashmla"]
            print(
                f"{s.s_q:>5} {s.h_q:>4} {s.topk:>5} {s.d_qk:>4} {s.s_kv:>7} {form:>5} {r['us']:>9.1f} "
                f"{r['tflops']:>8.1f} {r['pct_mma']:>5.1f} {fm if fm else '-':>9} {f'{ratio:.2f}' if ratio else '-':>6}",
                flush=True,
            )
            torch.cuda.empty_cache()
    path = harness.write_results(
        "prefill", dict(peak_tflops=peak_tflops, quick=args.quick, backend=args.backend, rows=rows), args.json
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
