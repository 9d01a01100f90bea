"""Serving path on a CUDA device at real shapes (skipped without one).

Fused quantise-and-store at prefill and decode sizes (byte-identical to ``quantize_k_cache``),
index conversion at DeepSeek-V3.2 shapes, no host synchronisation (``torch.cuda`` sync debug
mode), ``torch.library.opcheck`` on CUDA tensors, ``torch.compile`` and CUDA-graph capture of a
whole step through the registered ops, and the ``serve-sim`` loop at V3.2 size.
"""

from __future__ import annotations

import pytest
import torch
from cache_bytes import expected_after_store, storage_bytes
from helpers import check_decode_close

import sparse_mla as flash_mla
import sparse_mla.library as lib
from sparse_mla import (
    abs_indices_to_kvcache_indices,
    abs_indices_to_kvcache_indices_triton,
    get_layout,
    quantize_and_store_kv,
)
from sparse_mla.reference import quantize_and_store_kv_reference, sparse_decode_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def random_pool_cache(layout: str, nb: int, pbs: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A cache on the GPU whose whole storage holds random bytes (MODEL1 with padded blocks)."""
    lay = get_layout(layout)
    g = torch.Generator(device=DEV).manual_seed(seed)
    bb = lay.block_bytes(pbs)
    buf = torch.randint(0, 256, (nb * bb,), generator=g, dtype=torch.uint8, device=DEV)
    if lay.name == "V32":
        kc = buf.view(nb, pbs, 1, 656)
    else:
        kc = buf.as_strided((nb, pbs, 1, 584), (bb, 584, 584, 1))
    return kc if dtype == torch.uint8 else kc.view(dtype)


def random_tokens(n: int, d_qk: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, d_qk, generator=g, device=DEV)
    mag = 10.0 ** (torch.rand(n, d_qk // 64, generator=g, device=DEV) * 9 - 6)
    return (x * mag.repeat_interleave(64, dim=1)).to(torch.bfloat16)


@pytest.mark.parametrize("layout,dtype", [("V32", torch.float8_e4m3fn), ("MODEL1", torch.uint8)])
@pytest.mark.parametrize("n,pbs", [(64, 64), (4099, 61), (65536, 64)])
def test_store_real_shapes(layout, dtype, n, pbs):
    lay = get_layout(layout)
    nb = -(-2 * n // pbs) + 1
    kc = random_pool_cache(layout, nb, pbs, dtype, seed=n + pbs)
    kv = random_tokens(n, lay.d_qk, seed=n)
    g = torch.Generator(device=DEV).manual_seed(n + 1)
    slots = torch.randperm(nb * pbs, generator=g, device=DEV)[:n]
    slots[torch.rand(n, generator=g, device=DEV) < 0.1] = -1
    want = expected_after_store(kc, kv, slots)  # quantize_k_cache on the CPU, placed by offsets
    twin = random_pool_cache(layout, nb, pbs, dtype, seed=n + pbs)
    quantize_and_store_kv(kv, slots, kc)
    quantize_and_store_kv_reference(kv, slots, twin)
    torch.cuda.synchronize()
    got = storage_bytes(kc).cpu()
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
    assert torch.equal(storage_bytes(twin).cpu(), want)


@pytest.mark.parametrize("block_t", [1, 2, 4, 8])
def test_store_block_t_variants_agree(block_t):
    lay = get_layout("V32")
    n, pbs = 3000, 64
    nb = -(-n // pbs) + 2
    kc = random_pool_cache("V32", nb, pbs, torch.uint8, seed=1)
    kv = random_tokens(n, lay.d_qk, seed=2)
    slots = torch.randperm(nb * pbs, device=DEV)[:n]
    want = expected_after_store(kc, kv, slots)
    quantize_and_store_kv(kv, slots, kc, block_t=block_t)
    assert torch.equal(storage_bytes(kc).cpu(), want)


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_store_masks_out_of_range_slots_on_gpu(layout):
    """On CUDA the slot range is not checked on the host (that would sync): bad slots are skipped."""
    lay = get_layout(layout)
    nb, pbs = 5, 64
    kc = random_pool_cache(layout, nb, pbs, torch.uint8, seed=3)
    kv = random_tokens(6, lay.d_qk, seed=4)
    slots = torch.tensor([nb * pbs, -5, 7, 1 << 40, -1, nb * pbs - 1], device=DEV)
    want = expected_after_store(kc, kv, slots)
    quantize_and_store_kv(kv, slots, kc)  # no exception
    assert torch.equal(storage_bytes(kc).cpu(), want)


@pytest.mark.parametrize("s_q", [1, 2])
def test_index_conversion_v32_shapes(s_q):
    b, topk, pbs, ctx = 64, 2048, 64, 32768
    nlog = ctx // pbs
    table = torch.randperm(b * nlog, device=DEV).view(b, nlog).int()
    table[:, -3:] = -1
    pos = torch.rand(b * s_q, ctx, device=DEV).argsort(dim=1)[:, :topk].view(b, s_q, topk).int()
    pos[:, :, :5] = -1
    got = abs_indices_to_kvcache_indices_triton(pos, table, pbs)
    want = abs_indices_to_kvcache_indices(pos, table, pbs)
    assert torch.equal(got, want)
    assert (want >= 0).float().mean() > 0.9


def test_serving_calls_do_not_synchronise():
    b, topk, pbs, h_q = 8, 2048, 64, 128
    nlog = 16384 // pbs
    kc = random_pool_cache("V32", b * nlog, pbs, torch.float8_e4m3fn, seed=5)
    from sparse_mla import quantize_k_cache

    k = (torch.randn(b * nlog, pbs, 1, 576, device=DEV) * 0.3).to(torch.bfloat16)
    kc.copy_(quantize_k_cache(k, "V32"))
    table = torch.randperm(b * nlog, device=DEV).view(b, nlog).int()
    pos = torch.rand(b, 16384, device=DEV).argsort(dim=1)[:, :topk].view(b, 1, topk).int()
    kv = random_tokens(b, 576, seed=6)
    slots = torch.randperm(b * nlog * pbs, device=DEV)[:b]
    q = torch.randn(b, 1, h_q, 576, device=DEV).to(torch.bfloat16)
    meta, _ = flash_mla.get_mla_metadata()

    def step():
        quantize_and_store_kv(kv, slots, kc)
        abs_indices_to_kvcache_indices(pos, table, pbs)  # the PyTorch twin
        idx = abs_indices_to_kvcache_indices_triton(pos, table, pbs)
        return flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)

    step()  # compiles the kernels, fills the scheduler metadata (one host read)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


def _uint8_problem(b, h_q, topk, layout, seed):
    lay = get_layout(layout)
    pbs, nb = 64, 64
    g = torch.Generator(device=DEV).manual_seed(seed)
    from sparse_mla import quantize_k_cache

    k = (torch.randn(nb, pbs, 1, lay.d_qk, generator=g, device=DEV) * 0.5).to(torch.bfloat16)
    kc = quantize_k_cache(k, layout, out_dtype=torch.uint8)
    idx = torch.rand(b, 1, nb * pbs, device=DEV, generator=g).argsort(dim=-1)[..., :topk].int()
    q = torch.randn(b, 1, h_q, lay.d_qk, device=DEV, generator=g).to(torch.bfloat16)
    return q, kc, idx


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_opcheck_on_cuda(layout):
    lay = get_layout(layout)
    ok = {
        "test_schema": "SUCCESS",
        "test_autograd_registration": "SUCCESS",
        "test_faketensor": "SUCCESS",
        "test_aot_dispatch_dynamic": "SUCCESS",
    }
    q, kc, idx = _uint8_problem(4, 64, 512, layout, seed=7)
    meta, _ = flash_mla.get_mla_metadata()
    lib.sparse_decode(q, kc, idx, meta)
    st = lib.schedule_tensors(meta)
    assert (
        torch.library.opcheck(
            torch.ops.sparse_mla.sparse_decode.default, (q, kc, idx), dict(**st, sm_scale=lay.d_qk**-0.5)
        )
        == ok
    )
    kv = random_tokens(16, lay.d_qk, seed=8)
    slots = torch.randperm(kc.shape[0] * kc.shape[1], device=DEV)[:16]
    assert torch.library.opcheck(torch.ops.sparse_mla.quantize_and_store_kv.default, (kv, slots, kc)) == ok
    table = torch.randperm(64, device=DEV)[:32].view(4, 8).int()
    pos = torch.randint(-1, 8 * 64, (4, 2, 300), device=DEV, dtype=torch.int32)
    assert torch.library.opcheck(torch.ops.sparse_mla.abs_indices_to_kvcache_indices.default, (pos, table, 64)) == ok
    b, s_q, h_q = 3, 2, 64
    ns = torch.tensor([0, 2, 3, 6], dtype=torch.int32, device=DEV)
    o_acc = torch.randn(6, s_q, h_q, 512, device=DEV)
    l_acc = torch.randn(6, s_q, h_q, device=DEV)
    out = torch.zeros(b, s_q, h_q, 512, device=DEV, dtype=torch.bfloat16)
    lse = torch.zeros(b, h_q, s_q, device=DEV)
    assert torch.library.opcheck(torch.ops.sparse_mla.combine.default, (o_acc, l_acc, ns, out, lse)) == ok


def _step_fn(pbs, st, d_qk):
    def step(kv, slots, k_cache, pos, table, q):
        torch.ops.sparse_mla.quantize_and_store_kv(kv, slots, k_cache)
        idx = torch.ops.sparse_mla.abs_indices_to_kvcache_indices(pos, table, pbs)
        out, lse = torch.ops.sparse_mla.sparse_decode(q, k_cache, idx, **st, sm_scale=d_qk**-0.5)
        return out, lse, idx

    return step


def _step_inputs(layout, b=16, h_q=128, topk=2048, ctx=8192, pbs=64, seed=0):
    lay = get_layout(layout)
    nlog = ctx // pbs
    g = torch.Generator(device=DEV).manual_seed(seed)
    from sparse_mla import quantize_k_cache

    k = (torch.randn(b * nlog, pbs, 1, lay.d_qk, generator=g, device=DEV) * 0.3).to(torch.bfloat16)
    kc = quantize_k_cache(k, layout)
    table = torch.randperm(b * nlog, device=DEV, generator=g).view(b, nlog).int()
    return lay, kc, table


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_cuda_graph_of_ops_step(layout):
    """store + conversion + decode through torch.ops, captured once and replayed with new inputs."""
    b, h_q, topk, ctx, pbs = 16, 128, 2048, 8192, 64
    lay, kc, table = _step_inputs(layout, b, h_q, topk, ctx, pbs, seed=1)
    kv = random_tokens(b, lay.d_qk, seed=2)
    slots = torch.empty(b, dtype=torch.int64, device=DEV)
    pos = torch.empty(b, 1, topk, dtype=torch.int32, device=DEV)
    q = torch.empty(b, 1, h_q, lay.d_qk, dtype=torch.bfloat16, device=DEV)

    def refill(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        # O(1) values: the decode below attends these tokens, and random_tokens' 10^3 magnitudes
        # would put bf16 P·V rounding above docs/design.md §6's elementwise bound (helpers.random_latent_k)
        kv.copy_((torch.randn(b, lay.d_qk, device=DEV, generator=g) * 0.3).to(torch.bfloat16))
        slots.copy_(torch.randperm(kc.shape[0] * pbs, device=DEV, generator=g)[:b])
        pos.copy_(torch.rand(b, ctx, device=DEV, generator=g).argsort(dim=1)[:, :topk].view(b, 1, topk))
        q.copy_(torch.randn(b, 1, h_q, lay.d_qk, device=DEV, generator=g).to(torch.bfloat16))

    refill(10)
    meta, _ = flash_mla.get_mla_metadata()
    lib.sparse_decode(q, kc, abs_indices_to_kvcache_indices(pos, table, pbs), meta)
    step = _step_fn(pbs, lib.schedule_tensors(meta), lay.d_qk)
    step(kv, slots, kc, pos, table, q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, idx = step(kv, slots, kc, pos, table, q)
    for trial in range(3):
        refill(20 + trial)
        want_cache = expected_after_store(kc, kv, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(storage_bytes(kc).cpu(), want_cache)
        assert torch.equal(idx, abs_indices_to_kvcache_indices(pos, table, pbs))
        ro, rl = sparse_decode_reference(q, kc, idx, None, 512)
        check_decode_close(out, lse, ro, rl)


def test_torch_compile_step_on_cuda():
    b, h_q, topk, ctx, pbs = 8, 128, 2048, 8192, 64
    lay, kc, table = _step_inputs("V32", b, h_q, topk, ctx, pbs, seed=3)
    g = torch.Generator(device=DEV).manual_seed(4)
    kv = random_tokens(b, lay.d_qk, seed=5)
    slots = torch.randperm(kc.shape[0] * pbs, device=DEV, generator=g)[:b]
    pos = torch.rand(b, ctx, device=DEV, generator=g).argsort(dim=1)[:, :topk].view(b, 1, topk).int()
    q = torch.randn(b, 1, h_q, lay.d_qk, device=DEV, generator=g).to(torch.bfloat16)
    meta, _ = flash_mla.get_mla_metadata()
    lib.sparse_decode(q, kc, abs_indices_to_kvcache_indices(pos, table, pbs), meta)
    step = _step_fn(pbs, lib.schedule_tensors(meta), lay.d_qk)
    kc2 = kc.clone()
    want_cache = expected_after_store(kc, kv, slots)
    oe, le, _ = step(kv, slots, kc, pos, table, q)
    oc, lc, _ = torch.compile(step, fullgraph=True)(kv, slots, kc2, pos, table, q)
    torch.cuda.synchronize()
    assert torch.equal(storage_bytes(kc).cpu(), want_cache) and torch.equal(storage_bytes(kc2).cpu(), want_cache)
    assert torch.equal(oe, oc) and torch.equal(le, lc)


@pytest.mark.parametrize("layout,b,max_context,steps", [("V32", 64, 32768, 30), ("MODEL1", 8, 4096, 10)])
def test_serve_sim_v32_size(layout, b, max_context, steps):
    from sparse_mla.tools.serve_sim import ServeSim, ServeSimConfig

    cfg = ServeSimConfig(
        batch=b, topk=2048, max_context=max_context, steps=steps, h_q=128, page_block_size=64, layout=layout, seed=11
    )
    res = ServeSim(cfg, DEV).run(progress=False)
    assert res["graph"] is True
    assert res["check"]["ok"], res["check"]
    assert res["final_context_max"] == max_context
    assert len(res["latencies_ms"]) == steps and res["p99_ms"] >= res["p50_ms"] > 0
