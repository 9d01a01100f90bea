"""Triton split-KV decode + combine kernels vs the fp32 PyTorch reference.

On a machine without a GPU these run under the Triton interpreter (``TRITON_INTERPRET=1``, set
before Python starts) at small shapes; with CUDA they run compiled on the GPU. Every test draws
fresh random inputs and compares with :func:`sparse_mla.reference.sparse_decode_reference`
within docs/design.md §6's tolerances.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from helpers import check_decode_close, make_problem

import sparse_mla as flash_mla
from sparse_mla.reference import combine_reference, sparse_decode_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="kernels need a GPU or TRITON_INTERPRET=1 (set before starting pytest)",
)


def to_dev(p, device=DEVICE):
    return p.to(device)


def run_api(p, num_sms=None, q=None, indices=None, k_cache=None):
    meta, _ = flash_mla.get_mla_metadata(num_sms=num_sms)
    kw = p.api_kwargs()
    if indices is not None:
        kw["indices"] = indices
    return flash_mla.flash_mla_with_kvcache(
        p.q if q is None else q,
        p.k_cache if k_cache is None else k_cache,
        None,
        None,
        512,
        meta,
        is_fp8_kvcache=True,
        **kw,
    ) + (meta,)


def ref_of(p, k_cache=None):
    return sparse_decode_reference(
        p.q, p.k_cache if k_cache is None else k_cache, p.indices, None, 512, **p.ref_kwargs()
    )


def check(p, num_sms=None):
    out, lse, meta = run_api(p, num_sms)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    b, s_q, h_q, _ = p.q.shape
    assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    ro, rl = ref_of(p)
    check_decode_close(out, lse, ro, rl)
    return out, lse, meta


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (64, 2), (128, 1), (20, 2)])
@pytest.mark.parametrize("num_sms", [4, 132])
def test_matches_reference(layout, h_q, s_q, num_sms):
    seed = zlib.crc32(f"{layout}-{h_q}-{s_q}-{num_sms}".encode()) % 10_000
    p = to_dev(make_problem(b=3, s_q=s_q, h_q=h_q, topk=150, layout=layout, num_blocks=5, seed=seed))
    _, _, meta = check(p, num_sms)
    ns = meta.num_splits.tolist()
    split = any(ns[i + 1] - ns[i] > 1 for i in range(3))
    # many partitions for 3 batches: they are split and the combine kernel runs; few: none is
    assert split == (num_sms == 132)


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_topk_length_sink_extra(layout):
    p = to_dev(
        make_problem(
            b=4,
            s_q=2,
            h_q=16,
            topk=130,
            layout=layout,
            seed=11,
            topk_length=[0, 1, 64, 200],
            extra_topk=70,
            extra_topk_length=[70, 0, 5, 33],
            attn_sink=[float("inf"), float("-inf"), 0.5, -2.5, 3.0],
        )
    )
    for num_sms in (2, 132):
        out, lse, _ = check(p, num_sms)
        assert (out[:, :, 0::5].float() == 0).all()  # +inf sink zeroes the output


def test_lonely_queries():
    p = make_problem(b=3, s_q=2, h_q=16, topk=70, seed=5, topk_length=[0, 70, 3], attn_sink=[1.0])
    p.indices[1, 0] = -1  # every index invalid
    p.indices[1, 1, :] = 10_000_000  # every index out of range
    p.indices[2, :, :3] = -1  # the 3 counted indices are invalid
    p = to_dev(p)
    for num_sms in (2, 132):
        out, lse, _ = check(p, num_sms)
        assert torch.isposinf(lse).all() and (out.float() == 0).all()


def test_nan_in_unattended_slots_never_leaks():
    p = make_problem(b=2, s_q=1, h_q=16, topk=100, num_blocks=4, seed=3, invalid_frac=0.3, topk_length=[60, 100])
    used = torch.zeros(4 * 64, dtype=torch.bool)
    for i in range(2):
        n = p.topk_length[i].item()
        ix = p.indices[i, :, :n].flatten().long()
        used[ix[(ix >= 0) & (ix < used.numel())]] = True
    raw = p.k_cache.view(torch.uint8).view(4 * 64, -1)
    nan_bytes = torch.tensor([0x7F], dtype=torch.uint8)  # e4m3 NaN; also a NaN float32 scale
    raw[~used] = nan_bytes
    raw.view(torch.uint8)[~used, 512:528].view(torch.float32)[:] = float("nan")
    p = to_dev(p)
    for num_sms in (2, 132):
        out, lse, _ = check(p, num_sms)
        assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("page_block_size", [2, 61, 69])
@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_odd_page_block_sizes(page_block_size, layout):
    p = to_dev(
        make_problem(
            b=2,
            h_q=16,
            topk=96,
            layout=layout,
            num_blocks=200 // page_block_size + 2,
            page_block_size=page_block_size,
            seed=page_block_size,
        )
    )
    check(p, 8)


def test_uint8_cache_and_strided_views():
    p = make_problem(b=2, s_q=2, h_q=16, topk=80, seed=9, out_dtype=torch.uint8)
    # the cache as one layer of a layer-interleaved pool [num_blocks, 3 layers, pbs, 1, 656]
    nb, pbs = p.k_cache.shape[:2]
    pool = torch.randint(0, 255, (nb, 3, pbs, 1, 656), dtype=torch.uint8)
    pool[:, 1] = p.k_cache
    q_big = torch.randn(2, 2, 32, 576).to(torch.bfloat16)
    q_big[:, :, ::2] = p.q
    idx_big = torch.full((2, 2, 160), -7, dtype=torch.int32)
    idx_big[:, :, ::2] = p.indices
    p = to_dev(p)
    layer, q_nc, idx_nc = pool.to(DEVICE)[:, 1], q_big.to(DEVICE)[:, :, ::2], idx_big.to(DEVICE)[:, :, ::2]
    assert not layer.is_contiguous() and not q_nc.is_contiguous() and not idx_nc.is_contiguous()
    out, lse, _ = run_api(p, 4, q=q_nc, indices=idx_nc, k_cache=layer)
    ro, rl = ref_of(p)
    check_decode_close(out, lse, ro, rl)


def test_batch_permutation_is_bit_exact():
    p = to_dev(make_problem(b=4, s_q=1, h_q=16, topk=64, seed=21))
    out, lse, _ = run_api(p, 132)  # one piece per batch: no split whose position could change
    perm = torch.tensor([2, 0, 3, 1], device=DEVICE)
    out2, lse2, _ = run_api(p, 132, q=p.q[perm], indices=p.indices[perm])
    assert torch.equal(out2, out[perm]) and torch.equal(lse2, lse[:, :][perm])


def test_combine_blocks_validated():
    from sparse_mla.decode.kernels.combine import combine_fwd

    o_acc, l_acc = torch.zeros(3, 1, 16, 512, device=DEVICE), torch.zeros(3, 1, 16, device=DEVICE)
    out, lse = torch.zeros(2, 1, 16, 512, device=DEVICE), torch.zeros(2, 16, 1, device=DEVICE)
    ns = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    for bad in [(3, 64), (16, 100), (0, 64), (-16, 64), (16, 128.0), (16,), [16, 64]]:
        with pytest.raises(ValueError, match="^blocks"):
            combine_fwd(o_acc, l_acc, ns, out, lse, blocks=bad)
    for bad in [0, 3, -2, True, 2.0]:
        with pytest.raises(ValueError, match="^splits_per_step"):
            combine_fwd(o_acc, l_acc, ns, out, lse, splits_per_step=bad)


# default tile, the small-batch tile, and the split tile (2 splits a step: several steps of its online merge)
@pytest.mark.parametrize("blocks, steps", [(None, None), ((4, 64), None), ((4, 64), 2), (None, 4), ((4, 64), 32)])
@pytest.mark.parametrize("listed", [False, True], ids=["per-batch", "split-list"])
def test_combine_kernel_matches_reference(blocks, steps, listed):
    from sparse_mla.decode.kernels.combine import combine_fwd

    g = torch.Generator().manual_seed(4)
    s_q, h_q, d_v = 2, 20, 512
    num_splits = torch.tensor([0, 1, 4, 6, 9], dtype=torch.int32)
    rows = 9
    o_acc = torch.randn(rows, s_q, h_q, d_v, generator=g)
    l_acc = torch.randn(rows, s_q, h_q, generator=g) * 4
    l_acc[6:9, 0, :5] = float("-inf")  # lonely query in batch 3
    l_acc[4, 1, 7] = float("-inf")  # one empty split
    o_acc[6:9, 0, :5] = float("nan")  # never read when its weight is 0
    sink = torch.randn(h_q, generator=g)
    sink[3] = float("inf")
    outs = []
    for dev in ("cpu-ref", DEVICE):
        out = torch.full((4, s_q, h_q, d_v), 7.0)
        lse = torch.full((4, h_q, s_q), 7.0)
        if dev == "cpu-ref":
            combine_reference(o_acc, l_acc, num_splits, out, lse, sink)
        else:
            out, lse = out.to(dev), lse.to(dev)
            combine_fwd(
                o_acc.to(dev),
                l_acc.to(dev),
                num_splits.to(dev),
                out,
                lse,
                sink.to(dev),
                blocks=blocks,
                splits_per_step=steps,
                # [count, split batches...]; the entries past the count are never read
                split_list=torch.tensor([3, 1, 2, 3, 2**30, -9], dtype=torch.int32, device=dev) if listed else None,
            )
        outs.append((out.cpu(), lse.cpu()))
    (ro, rl), (ko, kl) = outs
    assert (ko[0] == 7.0).all() and (kl[0] == 7.0).all()  # single-split batch untouched
    assert torch.isposinf(kl[3, :5, 0]).all() and (ko[3, 0, :5] == 0).all()
    torch.testing.assert_close(ko, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl, rl, rtol=1e-6, atol=1e-6)
