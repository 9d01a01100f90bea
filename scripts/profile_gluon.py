"""Run the decode at one benchmark shape a few times: for ``ncu``, or with ``--breakdown`` to print
each kernel's GPU time per call (torch.profiler: decode kernel vs combine kernel).

    ncu --clock-control none -k regex:gluon --launch-skip 2 --launch-count 1 \
        python3 scripts/profile_gluon.py --b 64 --h-q 128
    python3 scripts/profile_gluon.py --b 1 --s-q 1 --breakdown
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import bench_decode as bd  # noqa: E402
import sparse_mla as flash_mla  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--b", type=int, default=64)
ap.add_argument("--h-q", type=int, default=128)
ap.add_argument("--s-q", type=int, default=2)
ap.add_argument("--topk", type=int, default=2048)
ap.add_argument("--calls", type=int, default=4)
ap.add_argument("--breakdown", action="store_true", help="per-kernel GPU time over 50 calls (torch.profiler)")
a = ap.parse_args()
q, kc, sets, lay = bd.make_inputs(a.b, a.h_q, a.s_q, a.topk, 576, 2)
meta, _ = flash_mla.get_mla_metadata()


def call(i):
    return flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=sets[i % 2])


for i in range(a.calls):
    call(i)
torch.cuda.synchronize()
if a.breakdown:
    n = 50
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            call(i)
        torch.cuda.synchronize()
    print(f"b={a.b} s_q={a.s_q} h_q={a.h_q}: {n} calls; {meta.table.num_sm_parts} partitions")
    for key in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=8, max_name_column_width=50))
            break
        except Exception as exc:  # the column's name depends on the torch version
            print("sort key", key, "failed:", exc)
print("done")
