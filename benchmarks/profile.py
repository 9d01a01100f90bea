"""Run the decode at one benchmark shape a few times: for ``ncu``, or with ``--breakdown`` to print
each kernel's GPU time per call (torch.profiler: decode kernel vs combine kernel).

    ncu --clock-control none -k regex:gluon --launch-skip 2 --launch-count 1 \\
        python3 -m benchmarks.profile --b 64 --h-q 128
    python3 -m benchmarks.profile --b 1 --s-q 1 --breakdown [--backend portable]
        [--smem-carveout 0] [--hopper-config half_stages=1,pv_regs=152]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from sparse_mla.decode import get_backend
from sparse_mla.decode.kernels.hopper import HopperConfig
from sparse_mla.decode.plan import plan_decode
from sparse_mla.decode.problem import validate_sparse_decode

from . import harness
from .variants import parse_variant


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--s-q", type=int, default=2)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--d-qk", type=int, default=576)
    ap.add_argument("--backend", default="auto")
    ap.add_argument(
        "--smem-carveout",
        type=int,
        default=0,
        help="HopperConfig.smem_carveout (percent hint before every launch; default 0: the most L1; -1: Triton's choice)",
    )
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument(
        "--hopper-config", default="", help="more HopperConfig fields KEY=V,... (as in benchmarks.variants --variant)"
    )
    ap.add_argument("--breakdown", action="store_true", help="per-kernel GPU time over 50 calls (torch.profiler)")
    a = ap.parse_args(argv)
    inp = harness.decode_inputs(harness.DecodeShape(a.b, a.h_q, a.s_q, a.topk, a.d_qk))
    problems = [validate_sparse_decode(q=inp.q, k_cache=inp.k_cache, indices=ix) for ix in inp.index_sets[:2]]
    plan = plan_decode(problems[0], backend=a.backend)
    hopper = plan.backend.name == "hopper"
    config = None
    if hopper:
        extra = parse_variant(f"cli=hopper:{a.hopper_config}")[2] if a.hopper_config else HopperConfig()
        config = dataclasses.replace(extra, smem_carveout=a.smem_carveout)
    launch = get_backend(plan.backend.name).launch
    print(f"backend {plan.backend.name}, {plan.table.num_sm_parts} partitions")

    def call(i):
        return launch(problems[i % 2], plan.table, config)

    for i in range(a.calls):
        call(i)
    torch.cuda.synchronize()
    if a.breakdown:
        n = 50
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(n):
                call(i)
            torch.cuda.synchronize()
        print(f"b={a.b} s_q={a.s_q} h_q={a.h_q}: {n} calls")
        for key in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
            try:
                print(prof.key_averages().table(sort_by=key, row_limit=8, max_name_column_width=50))
                break
            except Exception as exc:  # the column's name depends on the torch version
                print("sort key", key, "failed:", exc)
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
