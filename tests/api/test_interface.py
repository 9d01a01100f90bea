"""FlashMLA-compatible API (``sparse_mla.api``; docs/design.md §3): validation, scheduler reuse,
output contract and agreement with the reference.

Agreement tests run the PyTorch path (``TRITON_INTERPRET=0``) always, and the Triton kernels too
when ``TRITON_INTERPRET=1`` was set before pytest
started (``triton.jit`` reads it when a kernel is decorated).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import check_decode_close, make_cache, make_problem, triton_interpret_enabled

import sparse_mla
import sparse_mla as flash_mla
from sparse_mla import FlashMLASchedMeta
from sparse_mla.reference import sparse_decode_reference

INF = float("inf")

BACKENDS = [
    "reference",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not triton_interpret_enabled(),
            reason="the Triton path on the CPU needs TRITON_INTERPRET=1 at start-up",
        ),
    ),
]


@pytest.fixture
def backend(request, monkeypatch):
    name = request.param
    monkeypatch.setenv("TRITON_INTERPRET", "1" if name == "triton" else "0")
    return name


def call(p, meta=None, num_sms=None, **over):
    if meta is None:
        meta, _ = flash_mla.get_mla_metadata(num_sms=num_sms)
    kw = dict(p.api_kwargs())
    kw.update(over)
    q = kw.pop("q", p.q)
    k_cache = kw.pop("k_cache", p.k_cache)
    head_dim_v = kw.pop("head_dim_v", 512)
    kw.setdefault("is_fp8_kvcache", True)
    return flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, head_dim_v, meta, **kw)


def ref(p, k_cache=None):
    return sparse_decode_reference(p.q, p.k_cache if k_cache is None else k_cache, p.indices, **p.ref_kwargs())


# ------------------------------------------------------------------ public API surface


def test_drop_in_import():
    assert callable(flash_mla.get_mla_metadata) and callable(flash_mla.flash_mla_with_kvcache)
    assert flash_mla.FlashMLASchedMeta is FlashMLASchedMeta
    for name in sparse_mla.__all__:
        assert hasattr(sparse_mla, name), name


def test_get_mla_metadata_returns_empty_meta_and_none():
    res = flash_mla.get_mla_metadata()
    assert isinstance(res, tuple) and len(res) == 2
    meta, second = res
    assert isinstance(meta, FlashMLASchedMeta) and second is None
    assert not meta.have_initialized and meta.tile_scheduler_metadata is None and meta.num_splits is None
    # FlashMLA-style positional/keyword arguments are accepted and ignored
    meta2, none2 = flash_mla.get_mla_metadata(torch.zeros(2, dtype=torch.int32), 64, 1, num_heads_k=1)
    assert isinstance(meta2, FlashMLASchedMeta) and none2 is None and meta2 is not meta
    with pytest.raises(ValueError, match="num_sms"):
        flash_mla.get_mla_metadata(num_sms=0)
    with pytest.raises(ValueError, match="num_sms"):
        flash_mla.get_mla_metadata(num_sms=True)
    for bad in (1025, 8.0, "8"):
        with pytest.raises(ValueError, match="num_sms"):
            flash_mla.get_mla_metadata(num_sms=bad)
    # a NumPy integer is an int here, as in decode_workspace_bytes (same check, one helper)
    meta_np, _ = flash_mla.get_mla_metadata(num_sms=np.int64(16))
    assert meta_np.num_sms == 16 and type(meta_np.num_sms) is int


def test_seed_schedule_through_api(monkeypatch):
    """b=2, topk=128, h_q=128, 132 SMs: the walkthrough's table (66 partitions, num_splits [0, 2, 4])."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = make_problem(b=2, s_q=1, h_q=128, topk=128, layout="V32", num_blocks=4, seed=1)
    meta, _ = flash_mla.get_mla_metadata(num_sms=132)
    out, lse = call(p, meta)
    assert meta.have_initialized
    md = meta.tile_scheduler_metadata
    assert md.shape == (66, 8) and md.dtype == torch.int32
    assert md[:4, :7].tolist() == [
        [0, 0, 0, 1, 0, 0, 1],
        [0, 0, 1, 2, 1, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
        [1, 1, 1, 2, 1, 1, 0],
    ]
    assert torch.all(md[4:, 0] == 2) and torch.all(md[4:, 0] > md[4:, 1])
    assert meta.num_splits.tolist() == [0, 2, 4]
    check_decode_close(out, lse, *ref(p))


# ------------------------------------------------------------------ output contract and agreement


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
@pytest.mark.parametrize("h_q,s_q,num_sms", [(16, 1, 132), (64, 2, 16), (1, 2, 8)])
def test_shapes_dtypes_and_agreement(backend, layout, h_q, s_q, num_sms):
    p = make_problem(
        b=2,
        s_q=s_q,
        h_q=h_q,
        topk=130,
        layout=layout,
        num_blocks=4,
        seed=100 + h_q + 7 * s_q + num_sms + (layout == "MODEL1"),
    )
    meta, _ = flash_mla.get_mla_metadata(num_sms=num_sms)
    out, lse = call(p, meta)
    assert out.shape == (2, s_q, h_q, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (2, h_q, s_q) and lse.dtype == torch.float32
    assert out.device == p.q.device and lse.device == p.q.device
    check_decode_close(out, lse, *ref(p))
    if num_sms == 16:  # 8 partitions of payload 7 < 3 blocks + 5: batches split
        ns = meta.num_splits.tolist()
        assert any(ns[i + 1] - ns[i] > 1 for i in range(2)), "expected split batches"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_all_options_agree(backend, layout):
    p = make_problem(
        b=3,
        s_q=2,
        h_q=16,
        topk=100,
        layout=layout,
        num_blocks=4,
        seed=7,
        topk_length=[0, 65, 100],
        extra_topk=40,
        extra_topk_length=[0, 40, 3],
        attn_sink=[INF, -INF, 0.7, 15.0],
    )
    p.indices[1, 1] = -1
    for num_sms in (2, 132):
        out, lse = call(p, num_sms=num_sms, softmax_scale=0.05)
        ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, 0.05, **p.ref_kwargs())
        check_decode_close(out, lse, ro, rl)
        assert torch.all(out[0].float() == 0) and torch.all(torch.isposinf(lse[0]))  # lonely batch 0
        assert torch.all(out[:, :, 0::4].float() == 0)  # +inf sink heads


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_uint8_and_strided_pool_cache(backend):
    p = make_problem(b=2, s_q=1, h_q=16, topk=90, layout="V32", num_blocks=3, page_block_size=16, seed=9)
    ro, rl = ref(p)
    L = 3
    pool = torch.full((3, L, 16, 1, 656), 0xFF, dtype=torch.uint8)  # NaN bytes in the other layers
    pool[:, 1] = p.k_cache.view(torch.uint8)
    for kc in (p.k_cache.view(torch.uint8), pool[:, 1], pool.view(torch.float8_e4m3fn)[:, 1]):
        out, lse = call(p, k_cache=kc, num_sms=4)
        check_decode_close(out, lse, ro, rl)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_scheduler_reuse(backend):
    p = make_problem(b=2, s_q=1, h_q=16, topk=70, layout="V32", num_blocks=3, seed=12)
    meta, _ = flash_mla.get_mla_metadata(num_sms=6)
    out1, lse1 = call(p, meta)
    table = meta.table
    # same configuration, new q values: the table is reused (no recompute)
    p2 = make_problem(b=2, s_q=1, h_q=16, topk=70, layout="V32", num_blocks=3, seed=13)
    out2, lse2 = call(p2, meta)
    assert meta.table is table
    check_decode_close(out2, lse2, *ref(p2))
    assert not torch.equal(out1, out2)
    # a different shape with the same object is refused
    p3 = make_problem(b=3, s_q=1, h_q=16, topk=70, layout="V32", num_blocks=3, seed=14)
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        call(p3, meta)
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        call(p, meta, topk_length=torch.tensor([70, 3], dtype=torch.int32))
    p4 = make_problem(b=2, s_q=1, h_q=32, topk=70, layout="V32", num_blocks=3, seed=15)
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        call(p4, meta)


def test_nan_in_unattended_slots_does_not_leak(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = make_problem(
        b=2, s_q=1, h_q=16, topk=60, layout="V32", num_blocks=8, page_block_size=16, seed=16, invalid_frac=0.0
    )
    used = torch.zeros(128, dtype=torch.bool)
    used[p.indices.flatten().long()] = True
    raw = p.k_cache.view(torch.uint8).clone()
    raw.view(128, 656)[~used] = 0xFF
    assert (~used).sum() > 0
    out, lse = call(p, k_cache=raw, num_sms=5)
    assert torch.isfinite(out.float()).all()
    check_decode_close(out, lse, *ref(p))


# ------------------------------------------------------------------ validation


@pytest.fixture
def good(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return make_problem(b=2, s_q=1, h_q=16, topk=64, layout="V32", num_blocks=2, seed=20)


def _raises(exc, match, p, **over):
    with pytest.raises(exc, match=match):
        call(p, **over)


def test_good_call_passes(good):
    out, lse = call(good)
    assert out.shape == (2, 1, 16, 512)


def test_validation_q(good):
    _raises(TypeError, "^q:", good, q=good.q.float())
    _raises(TypeError, "^q:", good, q=good.q.half())
    _raises(TypeError, "^q:", good, q=good.q.tolist())
    _raises(ValueError, "^q:", good, q=good.q[0])  # 3-D
    _raises(ValueError, "^q:.*d_qk", good, q=good.q[..., :128].contiguous())
    _raises(ValueError, "^q:", good, q=torch.zeros(2, 1, 129, 576, dtype=torch.bfloat16))  # h_q > 128
    _raises(ValueError, "^q:", good, q=torch.zeros(2, 1, 0, 576, dtype=torch.bfloat16))  # h_q = 0
    _raises(
        ValueError, "^indices", good, q=torch.zeros(0, 1, 16, 576, dtype=torch.bfloat16)
    )  # b = 0 is valid, [2, ..] indices not
    wide = torch.zeros(2, 1, 16, 576 * 2, dtype=torch.bfloat16)[..., ::2]
    _raises(ValueError, "^q:", good, q=wide)


def test_validation_head_dim_v(good):
    _raises(ValueError, "^head_dim_v", good, head_dim_v=576)
    _raises(ValueError, "^head_dim_v", good, head_dim_v=128)
    _raises(ValueError, "^head_dim_v", good, head_dim_v=512.0)


def test_validation_k_cache(good):
    kc = good.k_cache
    _raises(ValueError, "^k_cache:.*h_kv", good, k_cache=torch.zeros(2, 64, 2, 656, dtype=torch.uint8))
    _raises(ValueError, "^k_cache:", good, k_cache=make_cache("MODEL1", 2, 64, seed=1)[1])  # 584 B/token
    _raises(ValueError, "^k_cache:", good, k_cache=kc.view(torch.uint8)[..., :600])
    _raises(TypeError, "^k_cache:", good, k_cache=torch.zeros(2, 64, 1, 656, dtype=torch.bfloat16))
    _raises(TypeError, "^k_cache:", good, k_cache=torch.zeros(2, 64, 1, 656, dtype=torch.int8))
    _raises(TypeError, "^k_cache:", good, k_cache=kc.tolist())
    _raises(ValueError, "^k_cache:", good, k_cache=torch.empty(2, 64, 1, 656, dtype=torch.uint8, device="meta"))
    _raises(ValueError, "^k_cache:", good, k_cache=kc.view(torch.uint8).view(2, 64, 656))
    _raises(ValueError, "^k_cache:", good, k_cache=torch.zeros(0, 64, 1, 656, dtype=torch.uint8))


def test_validation_indices(good):
    _raises(TypeError, "^indices:", good, indices=good.indices.long())
    _raises(TypeError, "^indices:", good, indices=good.indices.tolist())
    _raises(ValueError, "^indices:", good, indices=good.indices[0])
    _raises(ValueError, "^indices:", good, indices=good.indices[:1])  # wrong b
    _raises(ValueError, "^indices:", good, indices=torch.zeros(2, 2, 64, dtype=torch.int32))  # wrong s_q
    _raises(ValueError, "^indices:", good, indices=good.indices[..., :0])
    _raises(ValueError, "^indices:", good, indices=torch.zeros(2, 1, 64, dtype=torch.int32, device="meta"))


def test_validation_lengths(good):
    _raises(TypeError, "^topk_length:", good, topk_length=torch.tensor([1, 2], dtype=torch.int64))
    _raises(ValueError, "^topk_length:", good, topk_length=torch.tensor([1, 2, 3], dtype=torch.int32))
    _raises(ValueError, "^topk_length:", good, topk_length=torch.tensor([[1, 2]], dtype=torch.int32))
    _raises(TypeError, "^topk_length:", good, topk_length=[1, 2])
    _raises(ValueError, "^topk_length:", good, topk_length=torch.tensor([1, 2], dtype=torch.int32, device="meta"))


def test_validation_attn_sink(good):
    _raises(ValueError, "^attn_sink:", good, attn_sink=torch.zeros(8))
    _raises(ValueError, "^attn_sink:", good, attn_sink=torch.zeros(1, 16))
    _raises(TypeError, "^attn_sink:", good, attn_sink=torch.zeros(16, dtype=torch.bfloat16))
    _raises(TypeError, "^attn_sink:", good, attn_sink=torch.zeros(16, dtype=torch.float64))


def test_validation_extra_cache(good):
    ekc = make_cache("V32", 2, 16, seed=2)[1]
    eidx = torch.zeros(2, 1, 8, dtype=torch.int32)
    _raises(ValueError, "extra_indices_in_kvcache", good, extra_k_cache=ekc)
    _raises(ValueError, "extra_k_cache", good, extra_indices_in_kvcache=eidx)
    _raises(ValueError, "^extra_topk_length", good, extra_topk_length=torch.tensor([1, 2], dtype=torch.int32))
    _raises(
        ValueError,
        "^extra_k_cache:",
        good,
        extra_k_cache=make_cache("MODEL1", 2, 16, seed=3)[1],
        extra_indices_in_kvcache=eidx,
    )
    _raises(TypeError, "^extra_indices_in_kvcache:", good, extra_k_cache=ekc, extra_indices_in_kvcache=eidx.long())
    _raises(
        ValueError,
        "^extra_topk_length:",
        good,
        extra_k_cache=ekc,
        extra_indices_in_kvcache=eidx,
        extra_topk_length=torch.tensor([1], dtype=torch.int32),
    )
    out, lse = call(good, extra_k_cache=ekc, extra_indices_in_kvcache=eidx)  # the good combination
    assert out.shape == (2, 1, 16, 512)


def test_validation_flags(good):
    _raises(ValueError, "^is_fp8_kvcache", good, is_fp8_kvcache=False)
    _raises(ValueError, "^causal", good, causal=True)
    _raises(ValueError, "^num_splits", good, num_splits=torch.zeros(3, dtype=torch.int32))
    _raises(TypeError, "^softmax_scale", good, softmax_scale="0.1")
    _raises(ValueError, "^softmax_scale", good, softmax_scale=-1.0)
    _raises(ValueError, "^softmax_scale", good, softmax_scale=INF)


def test_numpy_scalars_accepted(good):
    # callers often pass numpy scalars (config values): same result as the Python numbers
    import numpy as np

    out, lse = call(good, softmax_scale=0.05)
    out2, lse2 = call(good, softmax_scale=np.float32(0.05), head_dim_v=np.int64(512))
    torch.testing.assert_close(out2.float(), out.float(), rtol=1e-6, atol=1e-6)
    _raises(ValueError, "^head_dim_v", good, head_dim_v=np.int64(576))


def test_validation_tile_scheduler_metadata(good):
    with pytest.raises(TypeError, match="^tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(
            good.q, good.k_cache, None, None, 512, None, is_fp8_kvcache=True, indices=good.indices
        )
    with pytest.raises(TypeError, match="^tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(
            good.q,
            good.k_cache,
            None,
            None,
            512,
            flash_mla.get_mla_metadata(),
            is_fp8_kvcache=True,
            indices=good.indices,
        )
    with pytest.raises(TypeError, match="^tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(
            good.q,
            good.k_cache,
            None,
            None,
            512,
            torch.zeros(66, 8, dtype=torch.int32),
            is_fp8_kvcache=True,
            indices=good.indices,
        )


def test_dense_path_refuses_the_sparse_extras(good):
    """Without indices the call is the dense decode (tests/decode/test_dense_decode.py), which
    takes none of the sparse decode's extras."""
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ValueError, match="^topk_length: only the sparse decode"):
        flash_mla.flash_mla_with_kvcache(
            good.q,
            good.k_cache,
            torch.zeros(2, 2, dtype=torch.int32),
            torch.tensor([64, 64], dtype=torch.int32),
            512,
            meta,
            is_fp8_kvcache=True,
            topk_length=torch.tensor([64, 64], dtype=torch.int32),
        )
    assert not meta.have_initialized


def test_failed_validation_leaves_meta_empty(good):
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(TypeError):
        call(good, meta, indices=good.indices.long())
    assert not meta.have_initialized
    out, _ = call(good, meta)  # still usable
    assert meta.have_initialized and out.shape == (2, 1, 16, 512)


def test_more_argument_errors():
    with pytest.raises(ValueError, match="^num_sms"):
        flash_mla.get_mla_metadata(num_sms=10**6)
    import sparse_mla.library as lib

    with pytest.raises(TypeError, match="^tile_scheduler_metadata"):
        lib.schedule_tensors(None)
    kc = flash_mla.quantize_k_cache(torch.randn(2, 4, 1, 576).to(torch.bfloat16))
    for bad in ("bf16", torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="^dtype"):
            flash_mla.dequantize_k_cache(kc, "V32", dtype=bad)


def test_meta_q_is_rejected_by_name():
    q = torch.empty(1, 1, 16, 576, dtype=torch.bfloat16, device="meta")
    kc = torch.empty(4, 16, 1, 656, dtype=torch.uint8, device="meta")
    idx = torch.empty(1, 1, 64, dtype=torch.int32, device="meta")
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ValueError, match="^q: expected a CPU or CUDA tensor"):
        flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)
