"""Index-conversion kernel (``sparse_mla.kvcache.kernels.index_convert``) vs its PyTorch twin
:func:`sparse_mla.abs_indices_to_kvcache_indices` (identical int32 results)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sparse_mla import abs_indices_to_kvcache_indices, abs_indices_to_kvcache_indices_triton

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="kernels need a GPU or TRITON_INTERPRET=1 (set before starting pytest)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(b, s_q, topk, pbs, nlog, seed, idx_dtype=torch.int32, bt_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    nphys = b * nlog + 7
    block_table = torch.randperm(nphys, generator=g)[: b * nlog].view(b, nlog).to(bt_dtype)
    block_table[torch.rand(b, nlog, generator=g) < 0.15] = -1  # unallocated logical blocks
    abs_idx = torch.randint(-3, nlog * pbs + 2 * pbs, (b, s_q, topk), generator=g).to(idx_dtype)
    return abs_idx.to(DEV), block_table.to(DEV)


@pytest.mark.parametrize(
    "b,s_q,topk,pbs,nlog,idx_dtype,bt_dtype",
    [
        (3, 2, 50, 16, 5, torch.int32, torch.int32),
        (2, 1, 1500, 64, 20, torch.int32, torch.int32),  # two column blocks of 1024, masked tail
        (4, 3, 33, 7, 9, torch.int64, torch.int64),  # odd page size, int64 inputs
        (1, 1, 1, 1, 3, torch.int32, torch.int64),
    ],
)
def test_matches_pytorch_twin(b, s_q, topk, pbs, nlog, idx_dtype, bt_dtype):
    abs_idx, table = random_case(b, s_q, topk, pbs, nlog, seed=b * 100 + topk, idx_dtype=idx_dtype, bt_dtype=bt_dtype)
    want = abs_indices_to_kvcache_indices(abs_idx, table, pbs)
    got = abs_indices_to_kvcache_indices_triton(abs_idx, table, pbs)
    assert got.dtype == torch.int32 and got.shape == abs_idx.shape
    assert torch.equal(got, want)
    if topk >= 33:
        assert (want == -1).any() and (want >= 0).sum() > topk // 3  # both kinds present


def test_strided_inputs_and_out_buffer():
    abs_idx, table = random_case(3, 4, 40, 8, 6, seed=5)
    big = torch.full((3, 4, 80), 99, dtype=torch.int32, device=DEV)
    big[..., ::2] = abs_idx
    view = big[..., ::2]  # stride 2 in topk
    table_wide = torch.full((3, 12), -7, dtype=torch.int32, device=DEV)
    table_wide[:, ::2] = table
    tview = table_wide[:, ::2]
    out = torch.full((3, 4, 40), 123, dtype=torch.int32, device=DEV)
    res = abs_indices_to_kvcache_indices_triton(view, tview, 8, out=out)
    assert res is out
    assert torch.equal(out, abs_indices_to_kvcache_indices(abs_idx, table, 8))


def test_edges():
    table = torch.tensor([[4, -1, 2]], dtype=torch.int32, device=DEV)
    pbs = 10
    pos = torch.tensor([[[0, 9, 10, 19, 20, 29, 30, -1, -100]]], dtype=torch.int32, device=DEV)
    got = abs_indices_to_kvcache_indices_triton(pos, table, pbs)
    assert got.tolist() == [[[40, 49, -1, -1, 20, 29, -1, -1, -1]]]
    empty = abs_indices_to_kvcache_indices_triton(pos, torch.zeros(1, 0, dtype=torch.int32, device=DEV), pbs)
    assert torch.all(empty == -1)


def test_rejects_bad_arguments():
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="^abs_indices"):
        abs_indices_to_kvcache_indices_triton(idx.float(), bt, 64)
    with pytest.raises(TypeError, match="^block_table: expected an int32 or int64 tensor .* got torch.float32"):
        abs_indices_to_kvcache_indices_triton(idx, bt.float(), 64)
    with pytest.raises(ValueError, match="^page_block_size"):
        abs_indices_to_kvcache_indices_triton(idx, bt, 0)
    with pytest.raises(ValueError, match="^block_table"):
        abs_indices_to_kvcache_indices_triton(idx, bt[:1], 64)
    with pytest.raises(TypeError, match="^out"):
        abs_indices_to_kvcache_indices_triton(idx, bt, 64, out=torch.zeros(2, 1, 4))
    with pytest.raises(ValueError, match="^out"):
        abs_indices_to_kvcache_indices_triton(idx, bt, 64, out=torch.zeros(2, 1, 5, dtype=torch.int32))


@pytest.mark.parametrize("fn", ["torch", "triton"])
def test_int32_overflow_and_empty_batch(fn):
    """Slots past int32 become -1 (they used to wrap to valid slots); b = 0 works."""
    conv = abs_indices_to_kvcache_indices if fn == "torch" else abs_indices_to_kvcache_indices_triton
    dev = DEV
    r = conv(
        torch.tensor([[[0, 1, 5]]], dtype=torch.int32, device=dev),
        torch.tensor([[2**30]], dtype=torch.int32, device=dev),
        4,
    )
    assert r.tolist() == [[[-1, -1, -1]]]
    r = conv(
        torch.tensor([[[3]]], dtype=torch.int32, device=dev), torch.tensor([[1]], dtype=torch.int32, device=dev), 2**30
    )
    assert r.tolist() == [[[2**30 + 3]]]
    r = conv(torch.zeros(0, 1, 4, dtype=torch.int32, device=dev), torch.zeros(0, 2, dtype=torch.int32, device=dev), 16)
    assert r.shape == (0, 1, 4)
    # int64 table entries whose product with the page size overflows int64 itself (2^62 * 16 wraps to
    # 0, (2^63 - 1) * 16 to -16): still no slot; the last int32 slot exactly is one; a NumPy page size
    big = torch.tensor([[2**62, 2**63 - 1, 2**60, (2**31 - 1) // 16]], dtype=torch.int64, device=dev)
    idx = torch.tensor([[[0, 16, 32, 48, 63]]], dtype=torch.int32, device=dev)
    assert conv(idx, big, np.int64(16)).tolist() == [[[-1, -1, -1, 2**31 - 16, 2**31 - 1]]]
    # an int64 position past int32 (no request is that long) is no slot, even where a table wide
    # enough has an entry for its block (1 MiB-token pages: position 2^31 + 3 is block 2048)
    wide = torch.zeros(1, 2049, dtype=torch.int32, device=dev)
    pos = torch.tensor([[[2**31 + 3, 2**31 - 1]]], dtype=torch.int64, device=dev)
    assert conv(pos, wide, 2**20).tolist() == [[[-1, 2**20 - 1]]]
