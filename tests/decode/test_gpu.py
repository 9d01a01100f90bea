"""Real-shape checks on a CUDA device (skipped without one).

DeepSeek-V3.2 shapes (topk 2048, 32K-token contexts of varied length in one paged cache),
MODEL1 shapes with an extra cache, odd page sizes, CUDA-graph capture and replay.
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_decode_close

import sparse_mla as flash_mla
from sparse_mla import abs_indices_to_kvcache_indices, quantize_k_cache
from sparse_mla.reference import sparse_decode_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def paged_context(b, max_ctx, page_block_size, layout, seed, min_ctx=None):
    """A paged FP8 cache holding b requests with random context lengths <= max_ctx.

    Returns (k_cache, block_table, ctx_lens). Physical blocks are shuffled across requests.
    """
    g = torch.Generator().manual_seed(seed)
    min_ctx = min_ctx or max_ctx // 4
    ctx = torch.randint(min_ctx, max_ctx + 1, (b,), generator=g)
    nblk = (ctx + page_block_size - 1) // page_block_size
    total = int(nblk.sum())
    perm = torch.randperm(total, generator=g)
    max_blocks = int(nblk.max())
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    at = 0
    for i in range(b):
        n = int(nblk[i])
        table[i, :n] = perm[at : at + n].int()
        at += n
    d_qk = 576 if layout == "V32" else 512
    gd = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(total, page_block_size, 1, d_qk, device=DEV, generator=gd)
    mag = 10.0 ** (
        torch.rand(total, page_block_size, 1, d_qk // 64, device=DEV, generator=gd) * 2 - 2
    )  # see helpers.random_latent_k
    k = (k * mag.repeat_interleave(64, dim=-1)).to(torch.bfloat16)
    return quantize_k_cache(k, layout), table.to(DEV), ctx


def topk_positions(ctx, s_q, topk, seed):
    """[b, s_q, topk] logical positions: distinct random tokens of each context (-1 past its end)."""
    g = torch.Generator().manual_seed(seed)
    b = ctx.shape[0]
    out = torch.full((b, s_q, topk), -1, dtype=torch.int32)
    for i in range(b):
        n = int(ctx[i])
        for s in range(s_q):
            k = min(topk, n)
            out[i, s, :k] = torch.randperm(n, generator=g)[:k].int()
    return out.to(DEV)


def run(q, kc, idx, **kw):
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx, **kw)
    ref_kw = {("extra_indices" if k == "extra_indices_in_kvcache" else k): v for k, v in kw.items()}
    ro, rl = sparse_decode_reference(q, kc, idx, None, 512, **ref_kw)
    check_decode_close(out, lse, ro, rl)
    return out, lse


@pytest.mark.parametrize("backend", ["auto", "tl"])  # auto: the Gluon kernel on Hopper
@pytest.mark.parametrize("b", [1, 2, 64, 128])
@pytest.mark.parametrize("h_q", [128, 64])
@pytest.mark.parametrize("s_q", [1, 2])
def test_v32_production_shapes(b, h_q, s_q, backend, monkeypatch):
    monkeypatch.setenv("SPARSE_MLA_BACKEND", backend)
    kc, table, ctx = paged_context(b, 32768, 64, "V32", seed=b * 7 + h_q + s_q, min_ctx=1024)
    pos = topk_positions(ctx, s_q, 2048, seed=b + s_q)
    idx = abs_indices_to_kvcache_indices(pos, table, 64)
    q = torch.randn(b, s_q, h_q, 576, device=DEV).to(torch.bfloat16)
    run(q, kc, idx)


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("extra_topk,extra_pbs", [(512, 64), (1024, 64), (512, 2)])
def test_model1_shapes(h_q, extra_topk, extra_pbs):
    b, s_q = 8, 2
    kc, table, ctx = paged_context(b, 8192, 256, "MODEL1", seed=h_q + extra_topk)
    ekc, etable, ectx = paged_context(b, 4096, extra_pbs, "MODEL1", seed=extra_topk + 1, min_ctx=600)
    idx = abs_indices_to_kvcache_indices(topk_positions(ctx, s_q, 128, 1), table, 256)
    eidx = abs_indices_to_kvcache_indices(topk_positions(ectx, s_q, extra_topk, 2), etable, extra_pbs)
    q = torch.randn(b, s_q, h_q, 512, device=DEV).to(torch.bfloat16)
    etl = torch.randint(0, extra_topk + 1, (b,), dtype=torch.int32, device=DEV)
    tl_ = torch.randint(0, 129, (b,), dtype=torch.int32, device=DEV)
    run(q, kc, idx, extra_k_cache=ekc, extra_indices_in_kvcache=eidx, extra_topk_length=etl, topk_length=tl_)


@pytest.mark.parametrize("pbs", [2, 61, 69, 576])
def test_odd_page_sizes_real_topk(pbs):
    b, s_q, h_q = 4, 2, 128
    kc, table, ctx = paged_context(b, 8192, pbs, "V32", seed=pbs)
    idx = abs_indices_to_kvcache_indices(topk_positions(ctx, s_q, 2048, pbs), table, pbs)
    q = torch.randn(b, s_q, h_q, 576, device=DEV).to(torch.bfloat16)
    sink = torch.randn(h_q, device=DEV)
    sink[:4] = float("inf")
    sink[4:8] = float("-inf")
    tl_ = torch.tensor([0, 2048, 1000, 1], dtype=torch.int32, device=DEV)
    run(q, kc, idx, attn_sink=sink, topk_length=tl_)


@pytest.mark.parametrize("backend", ["auto", "tl"])
def test_cuda_graph_capture_and_replay(backend, monkeypatch):
    monkeypatch.setenv("SPARSE_MLA_BACKEND", backend)
    b, s_q, h_q = 16, 2, 128
    kc, table, ctx = paged_context(b, 16384, 64, "V32", seed=5)
    q = torch.randn(b, s_q, h_q, 576, device=DEV).to(torch.bfloat16)
    idx = abs_indices_to_kvcache_indices(topk_positions(ctx, s_q, 2048, 3), table, 64)
    meta, _ = flash_mla.get_mla_metadata()

    def call():
        return flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)

    call()  # fills the scheduler metadata and compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    for trial in range(3):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))
        idx.copy_(abs_indices_to_kvcache_indices(topk_positions(ctx, s_q, 2048, 10 + trial), table, 64))
        graph.replay()
        torch.cuda.synchronize()
        ro, rl = sparse_decode_reference(q, kc, idx, None, 512)
        check_decode_close(out, lse, ro, rl)
