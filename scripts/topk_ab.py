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
from sparse_mla.runtime import next_pow2

CASES = [  # (label, rows, n, k, dtype, sorted)
    ("256 x 32768 unsorted", 256, 32768, 2048, torch.float32, False),
    ("256 x 32768 rank order", 256, 32768, 2048, torch.float32, True),
    ("64 x 32768 unsorted", 64, 32768, 2048, torch.float32, False),
    ("256 x 32768 bf16 unsorted", 256, 32768, 2048, torch.bfloat16, False),
    ("256 x 30000 unsorted", 256, 30000, 2048, torch.float32, False),
    ("256 x 32768 ramp unsorted", 256, 32768, 2048, "ramp", False),
    ("256 x 32768 recent block unsorted", 256, 32768, 2048, "recent", False),
    ("256 x 16384 unsorted", 256, 16384, 2048, torch.float32, False),
    ("256 x 12288 unsorted", 256, 12288, 2048, torch.float32, False),
    ("256 x 8192 unsorted", 256, 8192, 2048, torch.float32, False),
    ("256 x 4096 unsorted", 256, 4096, 2048, torch.float32, False),
    ("256 x 32768 bf16 rank order", 256, 32768, 2048, torch.bfloat16, True),
]


def _rows(rows: int, n: int, dt) -> torch.Tensor:
    """Random normal rows; ``"ramp"``: plus a rise of 4 along the row (later positions score higher);
    ``"recent"``: the last 1024 positions 3 higher (a block of recent tokens above the rest)."""
    x = torch.randn(rows, n, device="cuda")
    if dt == "ramp":
        return x + torch.linspace(0, 4, n, device="cuda")
    if dt == "recent":
        x[:, -1024:] += 3
        return x
    return x.to(dt)


def _flagged_rows(x: torch.Tensor, k: int, srt: bool) -> int | None:
    """How many rows the split path (when this config takes it) leaves to the register path."""
    cfg = K._topk_config(None)
    rows, n = x.shape
    if not getattr(K, "_launch_topk_split", None) or not cfg.get("split") or n < cfg["split"]:
        return None
    k_p2, n_p2 = next_pow2(k), next_pow2(n)
    out = torch.empty(rows, k, dtype=torch.int32, device=x.device)
    scr = torch.empty(rows, k_p2, dtype=torch.int64, device=x.device)
    flags = K._launch_topk_split(x, None, None, out, scr, k, k_p2, n_p2, out, False, 1, 1, srt, cfg)
    flags = flags[0] if isinstance(flags, tuple) else flags  # (an older src returned (flags, pdl))
    return int(flags.sum())


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
        x = _rows(rows, n, dt)
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
            flagged = _flagged_rows(x, k, srt)
            res[-1]["flagged_rows"] = flagged
            print(
                f"{label:28s} {json.dumps(cfg):40s} {us:8.1f} us  {'same set' if ok else 'DIFFERENT SET'}"
                + ("" if flagged is None else f"  split path: {flagged} of {rows} rows flagged"),
                flush=True,
            )
    K.TOPK_CONFIG.clear()
    K.TOPK_CONFIG.update(base)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(env=harness.environment(), rows=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
