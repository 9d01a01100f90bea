"""Run the decode at one benchmark shape a few times (for ``ncu`` / ``nvidia-smi`` on the device).

    ncu --clock-control none -k regex:gluon --launch-skip 2 --launch-count 1 \
        python3 scripts/profile_gluon.py --b 64 --h-q 128
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
a = ap.parse_args()
q, kc, sets, lay = bd.make_inputs(a.b, a.h_q, a.s_q, a.topk, 576, 2)
meta, _ = flash_mla.get_mla_metadata()
for i in range(a.calls):
    flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=sets[i % 2])
torch.cuda.synchronize()
print("done")
