"""Edges of the contract on every path (kernels, reference, custom ops): tensor views as arguments,
non-finite inputs, MODEL1 caches without block padding, empty steps, the interpreter switch.

Kernels run compiled on a GPU, else under Triton's interpreter (``tests/conftest.py`` selects it
on machines without CUDA). Every case is compared with the fp32 reference or the PyTorch twin.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import cache_to, check_decode_close, make_cache, make_problem

import sparse_mla as flash_mla
import sparse_mla.library as lib
from sparse_mla import abs_indices_to_kvcache_indices, dequantize_k_cache, quantize_k_cache
from sparse_mla.reference import combine_reference, quantize_and_store_kv_reference, sparse_decode_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS = ON_GPU or os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="kernels need a GPU or TRITON_INTERPRET=1")
INF, NAN = float("inf"), float("nan")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def to_dev(p):
    return p.to(DEVICE)


def view_of(t: torch.Tensor, kind: str, filler) -> torch.Tensor:
    """A view of ``t``'s values that is not a plain contiguous tensor: ``strided`` (every other
    element of a bigger tensor whose other elements are ``filler``), ``offset`` (a nonzero storage
    offset, ``filler`` before it), ``expanded`` (stride 0: ``t`` must hold one repeated value)."""
    n = t.shape[0]
    if kind == "strided":
        v = torch.stack([t, torch.full_like(t, filler)], dim=1)[:, 0]
        assert v.stride(0) == 2
    elif kind == "offset":
        v = torch.cat([torch.full_like(t[:1], filler).expand(3), t])[3:]
        assert v.storage_offset() == 3
    else:
        assert (t == t[0]).all()
        v = t[:1].expand(n)
        assert v.stride(0) == 0
    assert torch.equal(v, t)
    return v


def run_api(p, num_sms, **over):
    meta, _ = flash_mla.get_mla_metadata(num_sms=num_sms)
    kw = p.api_kwargs()
    kw.update(over)
    out, lse = flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, **kw)
    return out, lse


def run_op(p, num_sms, **over):
    meta, _ = flash_mla.get_mla_metadata(num_sms=num_sms)
    kw = {k: v for k, v in p.api_kwargs().items() if k != "indices"}
    kw.update(over)
    return lib.sparse_decode(p.q, p.k_cache, p.indices, meta, **kw)


# ------------------------------------------------------------------ 1. views of every tensor argument


@needs_kernels
@pytest.mark.parametrize("kind", ["strided", "offset", "expanded"])
@pytest.mark.parametrize("entry", [run_api, run_op], ids=["api", "op"])
@pytest.mark.parametrize("num_sms", [2, 132])  # whole batches, and split batches (combine)
def test_length_and_sink_views(kind, entry, num_sms):
    uniform = kind == "expanded"
    p = to_dev(
        make_problem(
            b=3,
            s_q=2,
            h_q=16,
            topk=130,
            seed=31,
            extra_topk=70,
            topk_length=[77] * 3 if uniform else [0, 77, 130],
            extra_topk_length=[5] * 3 if uniform else [70, 0, 5],
            attn_sink=[0.7] if uniform else [INF, -1.5, 0.3, 2.0],
        )
    )
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512, **p.ref_kwargs())
    # fillers that change the answer if read: length 0 (nothing attended), sink +inf (out 0)
    views = dict(
        topk_length=view_of(p.topk_length, kind, 0),
        extra_topk_length=view_of(p.extra_topk_length, kind, 0),
        attn_sink=view_of(p.attn_sink, kind, INF),
    )
    out, lse = entry(p, num_sms, **views)
    check_decode_close(out, lse, ro, rl)


@needs_kernels
def test_combine_empty_split_rows_holding_nan():
    # a split with no valid key (lse -inf) adds nothing whatever its partial row holds (NaN, inf);
    # a NaN lse makes its request's output NaN. The reference and the kernel agree on both
    from sparse_mla.decode.kernels.combine import combine_fwd

    g = torch.Generator().manual_seed(9)
    s_q, h_q, d_v = 1, 4, 512
    num_splits = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    o_acc = torch.randn(7, s_q, h_q, d_v, generator=g)
    l_acc = torch.randn(7, s_q, h_q, generator=g)
    l_acc[1], o_acc[1] = float("-inf"), float("nan")  # request 0: an empty split among two
    l_acc[3:5], o_acc[3], o_acc[4] = float("-inf"), float("nan"), float("inf")  # request 1: both empty
    l_acc[6, 0, 2] = float("nan")  # request 2: one head's lse NaN
    ro, rl = torch.zeros(3, s_q, h_q, d_v), torch.zeros(3, h_q, s_q)
    combine_reference(o_acc, l_acc, num_splits, ro, rl)
    assert torch.isfinite(ro[:2]).all() and (ro[1] == 0).all() and torch.isposinf(rl[1]).all()
    assert torch.isnan(ro[2, 0, 2]).all() and torch.isfinite(ro[2, 0, [0, 1, 3]]).all()
    out = torch.zeros(3, s_q, h_q, d_v, device=DEVICE)
    lse = torch.zeros(3, h_q, s_q, device=DEVICE)
    combine_fwd(o_acc.to(DEVICE), l_acc.to(DEVICE), num_splits.to(DEVICE), out, lse)
    torch.testing.assert_close(out.cpu(), ro, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(lse.cpu(), rl, rtol=1e-6, atol=1e-6, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("kind", ["strided", "offset"])
def test_combine_views(kind):
    from sparse_mla.decode.kernels.combine import combine_fwd

    g = torch.Generator().manual_seed(8)
    s_q, h_q, d_v, rows = 2, 16, 512, 6
    num_splits = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    o_acc = torch.randn(rows, s_q, h_q, d_v, generator=g)
    l_acc = torch.randn(rows, s_q, h_q, generator=g) * 3
    sink = torch.randn(h_q, generator=g)
    ro, rl = torch.zeros(3, s_q, h_q, d_v), torch.zeros(3, h_q, s_q)
    combine_reference(o_acc, l_acc, num_splits, ro, rl, sink)
    o_acc, l_acc, num_splits, sink = (t.to(DEVICE) for t in (o_acc, l_acc, num_splits, sink))
    if kind == "strided":  # lse_accum with a head stride of 2
        l_view = torch.stack([l_acc, torch.full_like(l_acc, 50.0)], dim=3)[..., 0]
    else:
        l_view = torch.cat([torch.full_like(l_acc[:1], 50.0), l_acc])[1:]
    assert torch.equal(l_view, l_acc) and (not l_view.is_contiguous() or l_view.storage_offset() > 0)
    for fn in (combine_fwd, torch.ops.sparse_mla.combine):
        out = torch.zeros(3, s_q, h_q, d_v, device=DEVICE)
        lse = torch.zeros(3, h_q, s_q, device=DEVICE)
        fn(o_acc, l_view, view_of(num_splits, kind, 99), out, lse, view_of(sink, kind, INF))
        torch.testing.assert_close(out.cpu(), ro, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.cpu(), rl, rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("kind", ["strided", "offset"])
def test_schedule_tensor_views_through_the_op(kind):
    p = to_dev(make_problem(b=2, h_q=16, topk=128, num_blocks=3, seed=12, topk_length=[100, 30]))
    meta, _ = flash_mla.get_mla_metadata(num_sms=32)
    out, lse = lib.sparse_decode(p.q, p.k_cache, p.indices, meta, topk_length=p.topk_length)
    st = lib.schedule_tensors(meta)
    assert st["any_split"]
    viewed = dict(st)
    for name in ("acc_rows", "main_blocks", "num_blocks"):
        viewed[name] = view_of(st[name], kind, 10_000)
    md = st["tile_scheduler_metadata"]
    big = torch.full((md.shape[0], md.shape[1] * 2), 10_000, dtype=md.dtype, device=md.device)
    big[:, ::2] = md
    viewed["tile_scheduler_metadata"] = big[:, ::2] if kind == "strided" else torch.cat([big[:1, :8], md])[1:]
    out2, lse2 = torch.ops.sparse_mla.sparse_decode(
        p.q, p.k_cache, p.indices, **viewed, sm_scale=576**-0.5, topk_length=p.topk_length
    )
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@needs_kernels
@pytest.mark.parametrize("kind", ["strided", "offset"])
def test_store_views(kind):
    k = torch.randn(8, 576).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 0, 17, 9, 30, 2, 11])
    want = quantize_k_cache(torch.zeros(4, 8, 1, 576, dtype=torch.bfloat16), "V32")
    quantize_and_store_kv_reference(k, slots, want)
    cache = cache_to(quantize_k_cache(torch.zeros(4, 8, 1, 576, dtype=torch.bfloat16), "V32"), DEVICE)
    kv_big = torch.zeros(8, 2, 576, dtype=torch.bfloat16)
    kv_big[:, 1] = k
    kv_view = kv_big[:, 1] if kind == "strided" else torch.cat([torch.zeros(1, 576, dtype=torch.bfloat16), k])[1:]
    flash_mla.quantize_and_store_kv(
        kv_view.to(DEVICE) if kind == "offset" else kv_big.to(DEVICE)[:, 1], view_of(slots.to(DEVICE), kind, 3), cache
    )
    assert torch.equal(cache.view(torch.uint8).cpu(), want.view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("kind", ["strided", "offset", "expanded"])
def test_index_conversion_views(kind):
    g = torch.Generator().manual_seed(2)
    b, s_q, topk, pbs = 3, 2, 40, 16
    table = torch.randperm(30, generator=g)[:8].int()
    block_table = torch.stack([table, table.flip(0), table + 1])
    abs_idx = torch.randint(-1, 8 * pbs + 3, (b, s_q, topk), generator=g).int()
    if kind == "expanded":
        block_table = table.expand(b, 8)
    want = abs_indices_to_kvcache_indices(abs_idx, block_table.contiguous(), pbs)
    block_table, abs_idx = block_table.contiguous().to(DEVICE), abs_idx.to(DEVICE)
    if kind == "strided":
        bt_v = torch.stack([block_table, torch.full_like(block_table, 7)], dim=2)[..., 0]
        ai_v = torch.stack([abs_idx, torch.full_like(abs_idx, 5)], dim=3)[..., 0]
    elif kind == "offset":
        bt_v = torch.cat([torch.full_like(block_table[:1], 7), block_table])[1:]
        ai_v = torch.cat([torch.full_like(abs_idx[:1], 5), abs_idx])[1:]
    else:
        bt_v, ai_v = block_table[:1].expand(b, 8), abs_idx.unsqueeze(0).expand(2, b, s_q, topk)[1]
        assert bt_v.stride(0) == 0
    got = flash_mla.abs_indices_to_kvcache_indices_triton(ai_v, bt_v, pbs)
    assert torch.equal(got.cpu(), want)


# ------------------------------------------------------------------ 5. non-finite inputs: one behaviour


def _paths():
    """(name, runner) of every decode path on this machine: the kernels and the reference path."""
    paths = [("reference", "0")]
    if KERNELS:
        paths.append(("kernels", "1" if DEVICE == "cpu" else None))
    return paths


@pytest.mark.parametrize("path,interp", _paths())
@pytest.mark.parametrize("num_sms", [2, 132])
def test_nan_sink_propagates(path, interp, num_sms, monkeypatch):
    if interp is not None:
        monkeypatch.setenv("TRITON_INTERPRET", interp)
    p = to_dev(
        make_problem(b=3, s_q=2, h_q=16, topk=70, seed=41, topk_length=[70, 0, 40], attn_sink=[NAN, 0.5, -1.0, INF])
    )
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512, **p.ref_kwargs())
    out, lse = run_api(p, num_sms)
    check_decode_close(out, lse, ro, rl, finite=False)
    nan_heads = out[:, :, 0::4].float()
    assert torch.isnan(nan_heads[[0, 2]]).all()  # NaN sink, queries with keys: NaN
    assert (nan_heads[1] == 0).all() and torch.isposinf(lse[1]).all()  # lonely: out 0, lse +inf
    assert torch.isfinite(lse[[0, 2]]).all()  # the sink leaves lse alone


@pytest.mark.parametrize("path,interp", _paths())
@pytest.mark.parametrize("num_sms", [2, 132])
def test_non_finite_q(path, interp, num_sms, monkeypatch):
    if interp is not None:
        monkeypatch.setenv("TRITON_INTERPRET", interp)
    # dim 0 of every cached token is positive: a -inf there gives every key a -inf score
    k, _ = make_cache("V32", 4, 64, seed=43)
    k[..., 0] = k[..., 0].abs() + 0.25
    p = make_problem(b=2, s_q=2, h_q=16, topk=90, num_blocks=4, seed=43, attn_sink=[0.5])
    p.k_cache = quantize_k_cache(k, "V32")
    p.q[0, 0, 3, 7] = INF  # scores of mixed sign infinity and NaN: NaN
    p.q[0, 1, 5, 0] = -INF  # every score -inf: no key gets weight, a lonely query
    p.q[1, 0, 2, 100] = NAN
    p = to_dev(p)
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512, **p.ref_kwargs())
    out, lse = run_api(p, num_sms)
    check_decode_close(out, lse, ro, rl, finite=False)
    assert torch.isnan(out[0, 0, 3].float()).all() and torch.isnan(lse[0, 3, 0])
    assert torch.isnan(out[1, 0, 2].float()).all() and torch.isnan(lse[1, 2, 0])
    assert (out[0, 1, 5].float() == 0).all() and torch.isposinf(lse[0, 5, 1])
    finite = torch.ones_like(lse, dtype=torch.bool)
    finite[0, 3, 0] = finite[1, 2, 0] = finite[0, 5, 1] = False
    assert torch.isfinite(lse[finite]).all()  # one bad head poisons only itself


@pytest.mark.parametrize("path,interp", _paths())
@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_nan_byte_in_an_attended_token(path, interp, layout, monkeypatch):
    # an e4m3 NaN byte (0x7F) in a token that is attended makes its scores NaN: out and lse NaN
    # for every head of that query, as the reference says (the interpreter's e4m3 cast read it as
    # 480, a finite wrong answer, until the portable kernel decoded the bytes itself there)
    if interp is not None:
        monkeypatch.setenv("TRITON_INTERPRET", interp)
    p = make_problem(b=2, s_q=1, h_q=16, topk=64, num_blocks=4, seed=47, layout=layout)
    raw = p.k_cache.view(torch.uint8)
    slot = next(int(x) for x in p.indices[1, 0] if x >= 0 and x not in p.indices[0])  # request 1's alone
    pbs = raw.shape[1]
    raw[slot // pbs, slot % pbs, 0, 3] = 0x7F  # a NoPE byte of the token (both layouts start with them)
    p = to_dev(p)
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512, **p.ref_kwargs())
    assert torch.isnan(rl[1]).all() and torch.isfinite(rl[0]).all()
    out, lse = run_api(p, 8)
    check_decode_close(out, lse, ro, rl, finite=False)
    assert torch.isnan(lse[1]).all() and torch.isnan(out[1].float()).all() and torch.isfinite(lse[0]).all()


# ------------------------------------------------------------------ 5. MODEL1 caches without block padding


@pytest.mark.parametrize("path,interp", _paths())
def test_model1_dense_copy_of_padded_cache(path, interp, monkeypatch):
    if interp is not None:
        monkeypatch.setenv("TRITON_INTERPRET", interp)
    p = make_problem(
        b=2, s_q=1, h_q=16, topk=100, layout="MODEL1", num_blocks=3, page_block_size=61, seed=45, extra_topk=40
    )
    padded = p.k_cache
    dense = padded.clone()  # what .clone() / .to(device) give: block stride 61 * 584, no padding
    assert dense.stride(0) == 61 * 584 < padded.stride(0)
    assert torch.equal(dequantize_k_cache(dense, "MODEL1"), dequantize_k_cache(padded, "MODEL1"))
    p = to_dev(p)
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512, **p.ref_kwargs())
    p.k_cache, p.extra_k_cache = dense.to(DEVICE), p.extra_k_cache.clone()
    out, lse = run_api(p, 8)
    check_decode_close(out, lse, ro, rl)
    out2, lse2 = run_op(p, 8)
    check_decode_close(out2, lse2, ro, rl)
    # the store writes the same bytes into a dense copy as into the padded original
    kv = torch.randn(5, 512).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([0, 60, 61, 150, 182]).to(DEVICE)
    flash_mla.quantize_and_store_kv(kv, slots, p.k_cache)
    padded_dev = cache_to(padded, DEVICE)
    flash_mla.quantize_and_store_kv(kv, slots, padded_dev)
    assert torch.equal(dequantize_k_cache(p.k_cache, "MODEL1"), dequantize_k_cache(padded_dev, "MODEL1"))


def test_model1_block_stride_below_its_bytes_is_rejected():
    raw = torch.zeros(3 * 2 * 584, dtype=torch.uint8)
    short = raw.as_strided((3, 2, 1, 584), (2 * 584 - 8, 584, 584, 1))
    meta, _ = flash_mla.get_mla_metadata()
    q = torch.randn(1, 1, 16, 512).to(torch.bfloat16)
    idx = torch.zeros(1, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="^k_cache: a MODEL1 block"):
        flash_mla.flash_mla_with_kvcache(q, short, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)
    with pytest.raises(ValueError, match="^k_cache"):
        flash_mla.quantize_and_store_kv(
            torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long), short
        )


@pytest.mark.parametrize("view", ["tokens", "one block", "extra", "packed half", "uint8 quarter", "fp8 of uint8"])
def test_model1_view_that_slices_tokens_is_rejected(view):
    """A MODEL1 view that keeps part of each block's tokens has its scale rows where its shape does
    not say (read as it is, every output is NaN): refused, naming the argument, whether its stride
    is no pool's (the padded cache sliced) or a two-layer pool's (a packed copy sliced in half: told
    by the view's base). Whole-block views, the padded pool and its dense copy stay accepted and agree."""
    _, kc = make_cache("MODEL1", 4, 64, seed=3)
    q = torch.randn(1, 1, 16, 512).to(torch.bfloat16)
    idx = torch.randint(0, 32, (1, 1, 32), dtype=torch.int32)
    _, ku = make_cache(
        "MODEL1", 4, 128, seed=3, out_dtype=torch.uint8
    )  # a byte cache: its views' base is a byte buffer
    sliced = {
        "one block": kc[:1, :32],
        "packed half": kc.clone()[:, :32],
        "uint8 quarter": ku[:, :32],
        "fp8 of uint8": ku[:, :32].view(torch.float8_e4m3fn),
    }.get(view, kc[:, :32])
    kw = dict(is_fp8_kvcache=True, backend="reference")
    if view == "extra":
        kw.update(extra_k_cache=sliced, extra_indices_in_kvcache=idx, indices=idx)
        cache, name = kc, "extra_k_cache"
    else:
        kw.update(indices=idx)
        cache, name = sliced, "k_cache"
    with pytest.raises(ValueError, match=f"^{name}: a MODEL1 block of 32 tokens .* slice whole blocks"):
        flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, flash_mla.get_mla_metadata()[0], **kw)
    with pytest.raises(ValueError, match="^k_cache: a MODEL1 block of 32 tokens"):
        flash_mla.quantize_and_store_kv(
            torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long), sliced
        )
    outs = []
    for whole in (kc[:2], kc[:2].clone(), kc.clone()[1:3]):  # whole blocks: padded, packed, a packed slice
        out, _ = flash_mla.flash_mla_with_kvcache(
            q, whole, None, None, 512, flash_mla.get_mla_metadata()[0], is_fp8_kvcache=True, indices=idx,
            backend="reference",
        )  # fmt: skip
        assert torch.isfinite(out.float()).all()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


# ------------------------------------------------------------------ 6. empty steps


@pytest.mark.parametrize("path,interp", _paths())
@pytest.mark.parametrize("b,s_q", [(0, 2), (3, 0), (0, 0)])
def test_empty_steps(path, interp, b, s_q, monkeypatch):
    if interp is not None:
        monkeypatch.setenv("TRITON_INTERPRET", interp)
    _, kc = make_cache("V32", 2, 64, seed=1)
    kc = cache_to(kc, DEVICE)
    q = torch.randn(b, s_q, 16, 576, device=DEVICE).to(torch.bfloat16)
    idx = torch.zeros(b, s_q, 64, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(b, dtype=torch.int32, device=DEVICE)
    sink = torch.zeros(16, device=DEVICE)
    meta, _ = flash_mla.get_mla_metadata()
    for fn in (
        lambda: flash_mla.flash_mla_with_kvcache(
            q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx, topk_length=lens, attn_sink=sink
        ),
        lambda: lib.sparse_decode(q, kc, idx, meta, topk_length=lens, attn_sink=sink),
    ):
        out, lse = fn()
        assert out.shape == (b, s_q, 16, 512) and out.dtype == torch.bfloat16 and out.device == q.device
        assert lse.shape == (b, 16, s_q) and lse.dtype == torch.float32
    assert not meta.have_initialized  # nothing was scheduled
    out, lse = torch.ops.sparse_mla.sparse_decode(
        q,
        kc,
        idx,
        torch.zeros(1, 8, dtype=torch.int32, device=DEVICE),
        torch.zeros(b + 1, dtype=torch.int32, device=DEVICE),
        torch.zeros(b, dtype=torch.int32, device=DEVICE),
        torch.zeros(b, dtype=torch.int32, device=DEVICE),
        False,
        0.1,
    )
    assert out.shape == (b, s_q, 16, 512) and lse.shape == (b, 16, s_q)
    # a bad argument of an empty step is still an error
    with pytest.raises(ValueError, match="^topk_length"):
        flash_mla.flash_mla_with_kvcache(
            q,
            kc,
            None,
            None,
            512,
            meta,
            is_fp8_kvcache=True,
            indices=idx,
            topk_length=torch.zeros(b + 1, dtype=torch.int32, device=DEVICE),
        )


# ------------------------------------------------------------------ 4. the interpreter switch


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env)
    full["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")])
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(ON_GPU, reason="CPU tensors only")
def test_interpreter_set_too_late_says_what_to_do():
    code = """
import os, torch
import sparse_mla as flash_mla
import sparse_mla.decode.kernels.portable  # kernels defined compiled
from helpers import make_problem
p = make_problem(b=1, h_q=16, topk=64)
os.environ["TRITON_INTERPRET"] = "1"
meta, _ = flash_mla.get_mla_metadata()
try:
    flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=p.indices)
except RuntimeError as e:
    print("ERR", e)
"""
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert "ERR TRITON_INTERPRET=1 was set after" in r.stdout and "before Python starts" in r.stdout


@pytest.mark.skipif(ON_GPU, reason="the conftest selects the interpreter only without CUDA")
def test_plain_pytest_runs_the_kernels_on_a_cpu():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            os.path.join(ROOT, "tests", "decode", "test_kernels.py") + "::test_lonely_queries",
        ],
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "skipped" not in r.stdout
    assert "Triton interpreter on the CPU" in r.stdout


@pytest.mark.skipif(ON_GPU, reason="CPU tensors only")
def test_triton_imported_before_the_interpreter_was_chosen():
    """Another library imported triton first: Triton's own functions are compiled ones, so the
    interpreter cannot run; a RuntimeError says so (not Triton's InterpreterError)."""
    code = """
import os, torch, triton
import sparse_mla as flash_mla
from helpers import make_problem
os.environ["TRITON_INTERPRET"] = "1"
p = make_problem(b=1, h_q=16, topk=64)
meta, _ = flash_mla.get_mla_metadata()
for fn in (lambda: flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                                    indices=p.indices),
           lambda: flash_mla.quantize_and_store_kv(p.k[0, :2, 0], torch.tensor([0, 1]), p.k_cache)):
    try:
        fn()
    except RuntimeError as e:
        print("ERR", e)
"""
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ERR TRITON_INTERPRET=1 was set after Triton") == 2, r.stdout


# ------------------------------------------------------------------------------ output buffers, repeated calls


def _decode(p, meta, **kw):
    return flash_mla.flash_mla_with_kvcache(
        p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, **{**p.api_kwargs(), **kw}
    )


@needs_kernels
def test_self_overlapping_or_aliasing_outputs_are_refused():
    p = to_dev(make_problem(b=2, s_q=1, h_q=16, topk=64, num_blocks=4, seed=31))
    meta, _ = flash_mla.get_mla_metadata()
    b, s_q, h_q = 2, 1, 16
    lse_x = torch.empty(1, h_q, s_q, device=DEVICE).expand(b, h_q, s_q)
    with pytest.raises(ValueError, match="^lse: its elements overlap"):
        _decode(p, meta, lse=lse_x)
    out_x = torch.empty(1, s_q, h_q, 512, dtype=torch.bfloat16, device=DEVICE).expand(b, s_q, h_q, 512)
    with pytest.raises(ValueError, match="^out: its elements overlap"):
        _decode(p, meta, out=out_x)
    # out over the queries (MODEL1: d_qk = d_v = 512, same dtype) and lse inside out
    p1 = to_dev(make_problem(b=2, s_q=1, h_q=16, topk=64, num_blocks=4, seed=32, layout="MODEL1"))
    with pytest.raises(ValueError, match="^out: must not overlap"):
        _decode(p1, meta, out=p1.q)
    out = torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="^lse: must not overlap"):
        _decode(p, meta, out=out, lse=out.view(torch.float32)[..., :1].reshape(b, s_q, h_q).transpose(1, 2))
    # disjoint slices of one buffer are fine
    buf = torch.empty(2 * b * s_q * h_q * 512, dtype=torch.bfloat16, device=DEVICE)
    o, lse = _decode(p, meta, out=buf[: b * s_q * h_q * 512].view(b, s_q, h_q, 512))
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512)
    check_decode_close(o, lse, ro, rl)


@needs_kernels
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_repeated_call_still_refuses_overlapping_outputs(backend):
    # a call with the geometry of the object's last validated one skips validation: the overlap of
    # out/lse with this call's tensors (addresses are not in the fingerprint) is still checked
    p = to_dev(make_problem(b=2, s_q=1, h_q=3, topk=64, num_blocks=4, seed=35))
    meta, _ = flash_mla.get_mla_metadata()
    b, s_q, h_q = 2, 1, 3
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512)
    o, lse = _decode(p, meta, backend=backend, out=torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device=DEVICE),
                     lse=torch.empty(b, h_q, s_q, device=DEVICE))  # fmt: skip
    check_decode_close(o, lse, ro, rl)
    buf = torch.empty(b * s_q * h_q * 512, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="^lse: must not overlap"):  # lse inside out
        _decode(
            p, meta, backend=backend, out=buf.view(b, s_q, h_q, 512), lse=buf.view(torch.float32)[:6].view(b, h_q, s_q)
        )
    raw = p.k_cache.view(torch.uint8).view(-1)
    before = raw.clone()
    inside_cache = raw[: b * s_q * h_q * 512 * 2].view(torch.bfloat16).view(b, s_q, h_q, 512)
    with pytest.raises(ValueError, match="^out: must not overlap"):  # out inside the cache
        _decode(p, meta, backend=backend, out=inside_cache, lse=torch.empty(b, h_q, s_q, device=DEVICE))
    assert torch.equal(raw, before)  # nothing written
    # the same geometry with disjoint buffers still takes the repeated-call path and is right
    o, lse = _decode(p, meta, backend=backend, out=torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device=DEVICE),
                     lse=torch.empty(b, h_q, s_q, device=DEVICE))  # fmt: skip
    check_decode_close(o, lse, ro, rl)


@needs_kernels
def test_outputs_overlapping_a_strided_vector_input_are_refused():
    # attn_sink / topk_length views are copied contiguous for the kernels; the overlap rule is
    # about the caller's tensors
    p = to_dev(make_problem(b=2, s_q=1, h_q=3, topk=64, num_blocks=4, seed=36))
    meta, _ = flash_mla.get_mla_metadata()
    buf = torch.randn(12, device=DEVICE)
    with pytest.raises(ValueError, match="^lse: must not overlap"):
        _decode(p, meta, attn_sink=buf[::2][:3], lse=buf[:6].view(2, 3, 1))
    ibuf = torch.full((2 * 3 * 512,), 64, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="^lse: must not overlap"):
        _decode(p, meta, topk_length=ibuf[::3][:2], lse=ibuf.view(torch.float32)[:6].view(2, 3, 1))


@needs_kernels
def test_a_repeated_call_checks_its_scalars_as_the_first():
    p = to_dev(make_problem(b=2, s_q=1, h_q=16, topk=64, num_blocks=4, seed=33))
    meta, _ = flash_mla.get_mla_metadata()
    _decode(p, meta, softmax_scale=1.0)
    with pytest.raises(TypeError, match="softmax_scale"):
        _decode(p, meta, softmax_scale=True)
    with pytest.raises((TypeError, ValueError), match="head_dim_v"):
        flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, 512.0, meta, is_fp8_kvcache=True, **p.api_kwargs())


@needs_kernels
def test_pool_views_at_other_offsets_share_the_scheduler_objects_entry(monkeypatch):
    # layers as views of one cache pool: one scheduler object, validated once for all of them
    import sparse_mla.decode.eager as ops

    p = to_dev(make_problem(b=2, s_q=1, h_q=16, topk=64, num_blocks=4, seed=34))
    pool = torch.cat([p.k_cache.view(torch.uint8)] * 2)  # two layers' caches, the same bytes
    layers = [pool[:4].view(p.k_cache.dtype), pool[4:].view(p.k_cache.dtype)]
    meta, _ = flash_mla.get_mla_metadata()
    calls = []
    real = ops.validate_sparse_decode
    monkeypatch.setattr(ops, "validate_sparse_decode", lambda **kw: calls.append(1) or real(**kw))
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512)
    for _step in range(3):
        for kc in layers:
            out, lse = flash_mla.flash_mla_with_kvcache(
                p.q, kc, None, None, 512, meta, is_fp8_kvcache=True, **p.api_kwargs()
            )
            check_decode_close(out, lse, ro, rl)
    assert len(calls) == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_gpu_than_the_current_one():
    # the kernels launch on the tensors' GPU, not on the current device
    p = make_problem(b=2, s_q=1, h_q=16, topk=64, num_blocks=4, seed=35).to("cuda:1")
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512)
    with torch.cuda.device(0):
        meta, _ = flash_mla.get_mla_metadata()
        out, lse = _decode(p, meta)
        out2, lse2 = _decode(p, meta)  # the repeated (replayed) call too
    assert out.device == torch.device("cuda:1")
    check_decode_close(out, lse, ro, rl)
    check_decode_close(out2, lse2, ro, rl)
