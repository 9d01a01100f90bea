"""Run each indexer kernel once on its benchmark shape, for a profiler to attach to (e.g.
``ncu --clock-control none -k regex:_topk_kernel -c 1 --set full python scripts/ncu_indexer.py topk``).

    python scripts/ncu_indexer.py [--config JSON] [topk|topk_unsorted|paged] ...

``--config``: ``TOPK_CONFIG`` items for the top-k runs (e.g. ``'{"split_digit_bits": 5}'``).
"""

from __future__ import annotations

import json
import sys

import torch

import sparse_mla as flash_mla
from sparse_mla.indexer import kernels as K


def topk() -> None:
    x = torch.randn(256, 32768, device="cuda")
    for _ in range(2):
        flash_mla.topk_indices(x, 2048)


def topk_unsorted() -> None:
    x = torch.randn(256, 32768, device="cuda")
    for _ in range(2):
        flash_mla.topk_indices(x, 2048, sorted=False)


def paged() -> None:
    b, next_n, h, d, blk, ctx_len = 128, 2, 64, 128, 64, 32768
    nblk = ctx_len // blk
    cache = torch.randint(0, 120, (b * nblk, blk, 1, d + 4), dtype=torch.uint8, device="cuda")
    cache.view(b * nblk, -1)[:, blk * d :].view(torch.float32).fill_(0.01)
    table = torch.randperm(b * nblk, device="cuda").view(b, nblk).int()
    q = torch.randn(b, next_n, h, d, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8)
    w = torch.rand(b * next_n, h, device="cuda")
    ctx = torch.full((b,), ctx_len, dtype=torch.int32, device="cuda")
    out = torch.empty(b * next_n, ctx_len, device="cuda")
    for _ in range(2):
        K.launch_paged_mqa_logits(q, cache, w, ctx, table, out, ctx_len)


if __name__ == "__main__":
    names = sys.argv[1:]
    if names[:1] == ["--config"]:
        K.TOPK_CONFIG.update(json.loads(names[1]))
        names = names[2:]
    for name in names or ["topk", "paged"]:
        {"topk": topk, "topk_unsorted": topk_unsorted, "paged": paged}[name]()
    torch.cuda.synchronize()
