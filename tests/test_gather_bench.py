"""The gather-ceiling benchmark's kernel (``benchmarks/gather.py``) against its PyTorch twin, in
Triton's interpreter on CPU (and compiled on a GPU): random slots, ``-1`` entries, a partial last
group, both V32 records and a strided pool view."""

from __future__ import annotations

import pytest
import torch

import sparse_mla as flash_mla
from benchmarks.gather import gather_max, gather_max_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n", [64, 150])
def test_gather_max_matches_twin(n):
    g = torch.Generator().manual_seed(n)
    k = torch.randn(6, 16, 1, 576, generator=g).to(torch.bfloat16)
    kc = flash_mla.quantize_k_cache(k, "V32").to(DEVICE)
    idx = torch.randint(-1, 6 * 16 + 8, (n,), generator=g, dtype=torch.int32)  # past the cache: skipped
    idx[:70] = -1 if n == 150 else idx[:70]  # group 0 of the longer list: no valid entry
    idx = idx.to(DEVICE)
    got = gather_max(kc, idx)
    want = gather_max_reference(kc, idx)
    assert got.shape == want.shape == (-(-n // 64),)
    assert torch.equal(got.cpu(), want.cpu())
    if n == 150:
        assert int(got[0]) == -(2**31)


def test_gather_max_pool_view_and_bad_records():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(8, 16, 1, 576, generator=g).to(torch.bfloat16)
    pool = flash_mla.quantize_k_cache(k, "V32").to(DEVICE)
    view = pool[2:6]  # an offset view: slots count from its first block
    idx = torch.randint(0, 4 * 16, (64,), generator=g, dtype=torch.int32).to(DEVICE)
    assert torch.equal(gather_max(view, idx).cpu(), gather_max_reference(view, idx).cpu())
    k1 = torch.randn(2, 16, 1, 512, generator=g).to(torch.bfloat16)
    m1 = flash_mla.quantize_k_cache(k1, "MODEL1").to(DEVICE)  # 584-byte records
    with pytest.raises(ValueError, match="k_cache: records of 584 bytes"):
        gather_max(m1, idx[:4].remainder(32))
    # a broadcast record (byte stride 0) would read past the storage: refused
    flat = torch.zeros(2, 16, 1, 16, dtype=torch.uint8, device=DEVICE)[..., :1].expand(2, 16, 1, 656)
    with pytest.raises(ValueError, match="k_cache: expected .* unit byte stride"):
        gather_max(flat, idx[:4].remainder(32))
    with pytest.raises(ValueError, match=r"out: expected a contiguous int32 \[1\]"):
        gather_max(view, idx, out=torch.empty(0, dtype=torch.int32, device=DEVICE))
    # strided and expanded index views are valid inputs
    for ix in (idx[::2], idx[:1].expand(64)):
        assert torch.equal(gather_max(view, ix).cpu(), gather_max_reference(view, ix).cpu())
