"""Graph-replay timing of the public top-k under several ``TOPK_CONFIG`` settings in one process
(each result checked against the default's set first), for A/B runs of the top-k kernels; pair it
with an older ``src`` on ``PYTHONPATH`` for before/after in one device call.

    python scripts/topk_ab.py [--quick] [--configs '[{}, {"bisect_prefetch": true}]'] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import sparse_mla as flash_mla
from benchmarks import harness
from sparse_mla.indexer import kernels as K

CASES = [  # (label, rows, n, k, dtype, sorted)
    ("256 x 32768 unsorted", 256, 32768, 2048, torch.float32, False),
    ("256 x 32768 rank order", 256, 32768, 2048, torch.float32, True),
    ("64 x 32768 unsorted", 64, 32768, 2048, torch.float32, False),
    ("256 x 32768 bf16 unsorted", 256, 32768, 2048, torch.bfloat16, False),
    ("256 x 30000 unsorted", 256, 30000, 2048, torch.float32, False),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", default="[{}]")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    configs = json.loads(a.configs)
    base = dict(K.TOPK_CONFIG)
    res = []
    for label, rows, n, k, dt, srt in CASES:
        x = torch.randn(rows, n, device="cuda").to(dt)
        want = None
        for cfg in configs:
            unknown = set(cfg) - set(base)
            if unknown:
                print(f"{label:28s} {json.dumps(cfg):40s} skipped (unknown keys here: {sorted(unknown)})")
                continue
            K.TOPK_CONFIG.clear()
            K.TOPK_CONFIG.update({**base, **cfg})
            out = flash_mla.topk_indices(x, k, sorted=srt)
            got = out.sort(dim=1).values
            want = got if want is None else want
            ok = torch.equal(got, want)
            call = lambda x=x, k=k, srt=srt: flash_mla.topk_indices(x, k, sorted=srt)  # noqa: E731
            us = harness.graph_replay_us(lambda i, call=call: call, 1, a.quick)
            res.append(dict(case=label, config=cfg, us_graph=us, same_set=ok))
            print(
                f"{label:28s} {json.dumps(cfg):40s} {us:8.1f} us  {'same set' if ok else 'DIFFERENT SET'}", flush=True
            )
    K.TOPK_CONFIG.clear()
    K.TOPK_CONFIG.update(base)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(env=harness.environment(), rows=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
