"""Per-kernel GPU time of one decode call (torch.profiler), e.g. decode kernel vs combine kernel.

    python3 scripts/kernel_breakdown.py --b 1 --s-q 1 --h-q 128
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
ap.add_argument("--b", type=int, default=1)
ap.add_argument("--h-q", type=int, default=128)
ap.add_argument("--s-q", type=int, default=1)
ap.add_argument("--topk", type=int, default=2048)
ap.add_argument("--calls", type=int, default=50)
a = ap.parse_args()
q, kc, sets, lay = bd.make_inputs(a.b, a.h_q, a.s_q, a.topk, 576, 2)
meta, _ = flash_mla.get_mla_metadata()


def call(i):
    return flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=sets[i % 2])


for i in range(5):
    call(i)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for i in range(a.calls):
        call(i)
    torch.cuda.synchronize()
print(f"b={a.b} s_q={a.s_q} h_q={a.h_q}: {a.calls} calls; {meta.table.num_sm_parts} partitions")
for key in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
    try:
        print(prof.key_averages().table(sort_by=key, row_limit=8, max_name_column_width=50))
        break
    except Exception as exc:  # the column's name depends on the torch version
        print("sort key", key, "failed:", exc)
