"""The fp32 reference (src/sparse_mla/reference.py): direct path vs an independent naive loop,
split-KV path vs direct path, combine arithmetic and the walkthrough's numeric examples."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_problem, random_indices

from sparse_mla.decode.scheduler import batch_num_blocks, schedule
from sparse_mla.formats import MODEL1, dequantize_k_cache, get_layout
from sparse_mla.reference import (
    LOG2E,
    combine_reference,
    combine_weights,
    sparse_decode_reference,
    sparse_decode_split_reference,
)

INF = float("inf")


# ------------------------------------------------------------------ an independent oracle


def naive_decode(
    q,
    k_cache,
    indices,
    layout,
    sm_scale=None,
    topk_length=None,
    attn_sink=None,
    extra_k_cache=None,
    extra_indices=None,
    extra_topk_length=None,
    d_v=512,
):
    """Per-query, per-head Python loop in float64 on ``dequantize_k_cache`` output."""
    lay = get_layout(layout)
    b, s_q, h_q, d_qk = q.shape
    scale = d_qk**-0.5 if sm_scale is None else sm_scale
    caches = [(dequantize_k_cache(k_cache, lay, torch.float32).view(-1, d_qk).double(), indices, topk_length)]
    if extra_k_cache is not None:
        caches.append(
            (
                dequantize_k_cache(extra_k_cache, lay, torch.float32).view(-1, d_qk).double(),
                extra_indices,
                extra_topk_length,
            )
        )
    out = torch.zeros(b, s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.zeros(b, h_q, s_q, dtype=torch.float64)
    for i in range(b):
        for s in range(s_q):
            rows = []
            for K, idx, tl in caches:
                for j in range(idx.shape[-1]):
                    t = int(idx[i, s, j])
                    if 0 <= t < K.shape[0] and (tl is None or j < int(tl[i])):
                        rows.append(K[t])
            for h in range(h_q):
                if not rows:
                    lse[i, h, s] = INF
                    continue
                Kmat = torch.stack(rows)
                sc = (Kmat @ q[i, s, h].double()) * scale
                m = sc.max()
                e = torch.exp(sc - m)
                L = e.sum()
                l_ = (m + torch.log(L)).item()
                o = (e / L) @ Kmat[:, :d_v]
                if attn_sink is not None:
                    sink = float(attn_sink[h])
                    if sink == INF:
                        o = o * 0
                    elif sink != -INF:
                        o = o / (1.0 + math.exp(sink - l_))
                out[i, s, h] = o
                lse[i, h, s] = l_
    return out, lse


def split_path(p, num_sm_parts, sm_scale=None):
    b, _, _, _ = p.q.shape
    tl = None if p.topk_length is None else p.topk_length.tolist()
    etl = None if p.extra_topk_length is None else p.extra_topk_length.tolist()
    extra = 0 if p.extra_indices is None else p.extra_indices.shape[-1]
    main, total = batch_num_blocks(b, p.indices.shape[-1], tl, extra, etl)
    sched = schedule(total, num_sm_parts, main_blocks=main)
    out, lse = sparse_decode_split_reference(p.q, p.k_cache, p.indices, sched, sm_scale, **p.ref_kwargs())
    return out, lse, sched


def assert_ref_close(out, lse, ref_out, ref_lse, rtol=1e-5):
    """fp32 vs fp32/fp64 agreement: |d| <= rtol * (|ref| + max |ref|) (fp32 rounding of scores of
    size ~20 moves every weight by ~1e-6 relative, so small entries get an absolute floor scaled to
    the tensor)."""
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    scale = ref_out.abs().max().item() if ref_out.numel() else 0.0
    torch.testing.assert_close(out.double(), ref_out.double(), rtol=rtol, atol=rtol * max(scale, 1e-3))
    # lse: +inf entries must coincide (assert_close treats equal infinities as close)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=rtol, atol=rtol)


CONFIGS = {
    "v32_h16": dict(b=2, s_q=1, h_q=16, topk=200, layout="V32"),
    "model1_h64_sq2": dict(b=2, s_q=2, h_q=64, topk=130, layout="MODEL1"),
    "v32_h1_topk_length": dict(b=3, s_q=1, h_q=1, topk=200, layout="V32", topk_length=[0, 70, 200]),
    "v32_extra": dict(
        b=3, s_q=2, h_q=16, topk=96, layout="V32", topk_length=[0, 0, 50], extra_topk=100, extra_topk_length=[0, 5, 100]
    ),
    "model1_extra_no_len": dict(b=2, s_q=1, h_q=16, topk=64, layout="MODEL1", extra_topk=70),
    "v32_sink": dict(b=2, s_q=2, h_q=16, topk=150, layout="V32", attn_sink=[INF, -INF, 0.5, -3.0, 8.0]),
    "model1_sink_extra_len": dict(
        b=2,
        s_q=2,
        h_q=1,
        topk=80,
        layout="MODEL1",
        topk_length=[10, 0],
        extra_topk=40,
        extra_topk_length=[40, 0],
        attn_sink=[1.5],
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_direct_matches_naive_loop(name):
    p = make_problem(seed=list(CONFIGS).index(name) * 10, **CONFIGS[name])
    out, lse = sparse_decode_reference(p.q, p.k_cache, p.indices, **p.ref_kwargs())
    ref_out, ref_lse = naive_decode(p.q, p.k_cache, p.indices, p.layout, **p.ref_kwargs())
    assert_ref_close(out, lse, ref_out, ref_lse, rtol=2e-5)
    assert torch.isfinite(out).all()
    assert out.abs().max() > 0  # not a trivial all-zero answer


def test_direct_matches_naive_custom_scale_uint8_cache():
    p = make_problem(b=2, s_q=1, h_q=4, topk=70, layout="V32", seed=5, out_dtype=torch.uint8)
    out, lse = sparse_decode_reference(p.q, p.k_cache, p.indices, sm_scale=0.01)
    ref_out, ref_lse = naive_decode(p.q, p.k_cache, p.indices, "V32", sm_scale=0.01)
    assert_ref_close(out, lse, ref_out, ref_lse)


def test_duplicate_indices_each_count():
    p = make_problem(b=1, s_q=1, h_q=4, topk=8, layout="V32", seed=6, invalid_frac=0.0)
    p.indices[0, 0, 4:] = p.indices[0, 0, 0]  # token 0 five times
    out, lse = sparse_decode_reference(p.q, p.k_cache, p.indices)
    ref_out, ref_lse = naive_decode(p.q, p.k_cache, p.indices, "V32")
    assert_ref_close(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("num_sm_parts", [1, 3, 40])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_path_matches_direct(name, num_sm_parts):
    p = make_problem(seed=list(CONFIGS).index(name) * 10 + 7, **CONFIGS[name])
    ref_out, ref_lse = sparse_decode_reference(p.q, p.k_cache, p.indices, **p.ref_kwargs())
    out, lse, sched = split_path(p, num_sm_parts)
    assert_ref_close(out, lse, ref_out, ref_lse, rtol=1e-5)
    ns = sched.num_splits.tolist()
    if num_sm_parts == 40:
        assert any(ns[i + 1] - ns[i] > 1 for i in range(len(ns) - 1)), "nothing was split: test is vacuous"
    if num_sm_parts == 1:
        assert all(ns[i + 1] - ns[i] == 1 for i in range(len(ns) - 1))


# ------------------------------------------------------------------ special semantics


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_lonely_queries(layout):
    """No valid key: out = 0, lse = +inf (also with a sink, and when split)."""
    p = make_problem(
        b=3, s_q=2, h_q=16, topk=130, layout=layout, seed=8, topk_length=[130, 130, 0], attn_sink=[0.0, INF, -INF, -1.0]
    )
    p.indices[0, 1] = -1  # batch 0, query 1: every index -1
    p.indices[1, 0] = p.k_cache.shape[0] * p.k_cache.shape[1] + 3  # batch 1, query 0: all out of range
    for out, lse in (
        sparse_decode_reference(p.q, p.k_cache, p.indices, **p.ref_kwargs()),
        split_path(p, 40)[:2],
        split_path(p, 1)[:2],
    ):
        assert torch.isfinite(out).all()
        for i, s in ((0, 1), (1, 0), (2, 0), (2, 1)):
            assert torch.all(out[i, s] == 0)
            assert torch.all(torch.isposinf(lse[i, :, s]))
        assert torch.isfinite(lse[0, :, 0]).all() and torch.isfinite(lse[1, :, 1]).all()
        assert out[0, 0].abs().max() > 0


def test_attn_sink_semantics():
    """out scaled by exp(lse)/(exp(lse)+exp(sink)); lse unchanged; +inf -> 0; -inf -> no effect."""
    p = make_problem(b=2, s_q=2, h_q=4, topk=100, layout="V32", seed=9)
    base_out, base_lse = sparse_decode_reference(p.q, p.k_cache, p.indices)
    # finite sinks of the size of the lse, so that they matter (factor 0.5 at one query)
    sink = torch.tensor([INF, -INF, base_lse[0, 2, 0].item(), base_lse[:, 3].mean().item() - 1.0])
    p.attn_sink = sink
    for out, lse in (
        sparse_decode_reference(p.q, p.k_cache, p.indices, attn_sink=sink),
        split_path(p, 20)[:2],
    ):
        torch.testing.assert_close(lse, base_lse, rtol=1e-6, atol=1e-6)
        assert torch.all(out[:, :, 0] == 0)
        torch.testing.assert_close(out[:, :, 1], base_out[:, :, 1], rtol=1e-5, atol=1e-5)
        for h in (2, 3):
            f = torch.sigmoid(base_lse[:, h, :].double() - sink[h].double()).float()  # [b, s_q]
            torch.testing.assert_close(out[:, :, h], base_out[:, :, h] * f.unsqueeze(-1), rtol=1e-5, atol=1e-5)
            assert f.max() < 1.0 and f.min() < 0.95
        torch.testing.assert_close(out[0, 0, 2], base_out[0, 0, 2] * 0.5, rtol=1e-5, atol=1e-5)


def _poison_unindexed(kc: torch.Tensor, layout: str, exclude: torch.Tensor) -> torch.Tensor:
    """Copy of ``kc`` with every byte of the excluded token slots (and MODEL1 block padding) = 0xFF,
    which is NaN as e4m3, as float32 scale, as bf16 RoPE (and 2^128 as an e8m0 scale)."""
    lay = get_layout(layout)
    nb, pbs = kc.shape[0], kc.shape[1]
    u8 = kc.view(torch.uint8) if kc.dtype != torch.uint8 else kc
    store = u8.as_strided((u8.untyped_storage().nbytes(),), (1,), 0).clone()
    bad = exclude.view(nb, pbs)
    if lay.name == "V32":
        rec = store.view(nb, pbs, 656)
        rec[bad] = 0xFF
    else:
        bb = lay.block_bytes(pbs)
        blocks = store.view(nb, bb)
        for bi in range(nb):
            blocks[bi, pbs * 584 :] = 0xFF  # padding
            for ti in range(pbs):
                if bad[bi, ti]:
                    blocks[bi, ti * 576 : (ti + 1) * 576] = 0xFF
                    blocks[bi, pbs * 576 + ti * 8 : pbs * 576 + ti * 8 + 8] = 0xFF
    new = store.as_strided(u8.shape, u8.stride(), 0)
    return new if kc.dtype == torch.uint8 else new.view(kc.dtype)


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_nan_in_unindexed_slots_never_leaks(layout):
    p = make_problem(
        b=2,
        s_q=2,
        h_q=16,
        topk=100,
        layout=layout,
        num_blocks=4,
        page_block_size=64,
        seed=10,
        topk_length=[100, 37],
        attn_sink=[0.3],
    )
    n_tok = 4 * 64
    g = torch.Generator().manual_seed(11)
    exclude = torch.rand(n_tok, generator=g) < 0.4
    exclude[0] = True  # slot 0 is what invalid indices are redirected to internally
    p.indices = random_indices(2, 2, 100, n_tok, seed=12, invalid_frac=0.15, exclude=exclude)
    # positions past topk_length may point at poisoned slots: they must be ignored too
    poisoned_ids = exclude.nonzero().flatten()
    p.indices[1, :, 37:] = poisoned_ids[:63].to(torch.int32)
    clean_out, clean_lse = sparse_decode_reference(p.q, p.k_cache, p.indices, **p.ref_kwargs())
    clean_split = split_path(p, 30)[:2]
    p.k_cache = _poison_unindexed(p.k_cache, layout, exclude)
    assert torch.isnan(dequantize_k_cache(p.k_cache, layout, torch.float32)).any()  # the poison is there
    out, lse = sparse_decode_reference(p.q, p.k_cache, p.indices, **p.ref_kwargs())
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.equal(out, clean_out) and torch.equal(lse, clean_lse)
    s_out, s_lse, sched = split_path(p, 30)
    assert sched.num_splits[-1] > 2  # splits happened
    assert torch.isfinite(s_out).all()
    assert torch.equal(s_out, clean_split[0]) and torch.equal(s_lse, clean_split[1])


# ------------------------------------------------------------------ combine and the walkthrough's numbers


def test_seed_combine_example():
    """The walkthrough's step 16: split LSEs (log2 space) 4.2, 3.8, 2.1.

    The walkthrough writes the weights as 1.0, 0.7579, 0.1353 and their sum as 1.8932, but
    0.1353 = e^-2 is an arithmetic slip: the third weight is exp2(2.1 - 4.2) = 2^-2.1 = 0.2333,
    so the sum is 1.9912. The first two of its numbers are right.
    """
    w, tot = combine_weights(torch.tensor([4.2, 3.8, 2.1]))
    assert w[0].item() == 1.0
    assert w[1].item() == pytest.approx(0.7579, abs=5e-5)  # the walkthrough's value
    assert w[2].item() == pytest.approx(0.2333, abs=5e-5)
    assert w[2].item() != pytest.approx(0.1353, abs=1e-2)  # the walkthrough's erroneous value
    assert tot.item() == pytest.approx(1.9912, abs=1e-4)
    assert tot.item() != pytest.approx(1.8932, abs=1e-2)
    # and the merged output / lse of combine_reference with these three splits
    g = torch.Generator().manual_seed(13)
    o_acc = torch.randn(3, 1, 1, 512, generator=g)
    l_acc = torch.tensor([4.2, 3.8, 2.1]).view(3, 1, 1)
    out = torch.zeros(1, 1, 1, 512)
    lse = torch.zeros(1, 1, 1)
    combine_reference(o_acc, l_acc, torch.tensor([0, 3], dtype=torch.int32), out, lse)
    wt = torch.tensor([1.0, 2**-0.4, 2**-2.1])
    expect = (wt.view(3, 1) * o_acc.view(3, 512)).sum(0) / wt.sum()
    torch.testing.assert_close(out.view(512), expect, rtol=1e-6, atol=1e-6)
    assert lse.item() == pytest.approx((4.2 + math.log2(wt.sum().item())) / LOG2E, rel=1e-6)


def test_combine_weights_with_empty_splits():
    w, tot = combine_weights(torch.tensor([[-INF, 1.0, -INF], [-INF, -INF, -INF]]))
    assert w[0].tolist() == [0.0, 1.0, 0.0] and tot[0].item() == 1.0
    assert w[1].tolist() == [0.0, 0.0, 0.0] and tot[1].item() == 0.0  # no NaN for all-empty


def test_combine_reference_lonely_and_single_split():
    """All splits empty -> out 0, lse +inf; a batch with one split is left untouched."""
    o_acc = torch.full((3, 1, 2, 512), float("nan"))
    o_acc[1] = 0.0
    o_acc[2] = 0.0
    l_acc = torch.full((3, 1, 2), -INF)
    out = torch.full((2, 1, 2, 512), 7.0)
    lse = torch.full((2, 2, 1), 7.0)
    combine_reference(
        o_acc, l_acc, torch.tensor([0, 1, 3], dtype=torch.int32), out, lse, attn_sink=torch.tensor([INF, 0.0])
    )
    assert torch.all(out[0] == 7.0) and torch.all(lse[0] == 7.0)  # one split: untouched
    assert torch.all(out[1] == 0.0) and torch.all(torch.isposinf(lse[1]))


def test_seed_no_split_lse_and_sink_example():
    """The walkthrough's steps 13-14: L = 80.7, M = 0.2116 (log2 space) -> lse = ln(80.7) + 0.2116/log2(e) = 4.538;
    sink -2.5 -> o_scale = 1 / (80.7 + 2^(-2.5 log2 e - 0.2116)) = 1 / 80.77."""
    L, M = 80.7, 0.2116
    lse_nat = math.log(L) + M / LOG2E
    assert lse_nat == pytest.approx(4.538, abs=1e-3)
    o_scale = 1.0 / (L + 2 ** (-2.5 * LOG2E - M))
    assert o_scale == pytest.approx(1 / 80.77, rel=2e-4)
    assert o_scale == pytest.approx(0.01238, abs=1e-5)
    # the same through combine_reference: two splits of L/2 each (same M) merge to (L, M);
    # partial outputs are normalised (acc / L_i), so all-ones partials give out = L * o_scale
    l2 = math.log2(L / 2) + M
    o_acc = torch.ones(2, 1, 1, 512)
    l_acc = torch.full((2, 1, 1), l2)
    out = torch.zeros(1, 1, 1, 512)
    lse = torch.zeros(1, 1, 1)
    combine_reference(o_acc, l_acc, torch.tensor([0, 2], dtype=torch.int32), out, lse, attn_sink=torch.tensor([-2.5]))
    assert lse.item() == pytest.approx(lse_nat, rel=1e-6)
    assert lse.item() == pytest.approx(4.538, abs=1e-3)
    torch.testing.assert_close(out, torch.full_like(out, L * o_scale), rtol=1e-6, atol=0)
    assert out[0, 0, 0, 0].item() == pytest.approx(80.7 / 80.77, rel=2e-4)


def test_model1_value_dims_are_first_512_of_k():
    """MODEL1: v = the 448 NoPE dims + the 64 RoPE dims (d_v = d_qk = 512)."""
    assert MODEL1.d_v == MODEL1.d_qk == 512
    p = make_problem(b=1, s_q=1, h_q=2, topk=1, layout="MODEL1", seed=14, invalid_frac=0.0)
    out, lse = sparse_decode_reference(p.q, p.k_cache, p.indices)
    k = dequantize_k_cache(p.k_cache, "MODEL1", torch.float32).view(-1, 512)[p.indices[0, 0, 0]]
    torch.testing.assert_close(out[0, 0], k.expand(2, 512), rtol=1e-6, atol=1e-6)  # one key: weight 1


# ------------------------------------------------------------------ the tolerance checker itself


def test_check_decode_close_accepts_and_rejects():
    """helpers.check_decode_close (used by the kernel tests) enforces docs/design.md §6."""
    from helpers import check_decode_close

    g = torch.Generator().manual_seed(15)
    ref_out = torch.randn(2, 1, 4, 512, generator=g)
    ref_lse = torch.randn(2, 4, 1, generator=g) * 5 + 10
    ref_lse[1, 2, 0] = INF  # a lonely query
    ref_out[1, 0, 2] = 0.0
    # bf16 rounding of out and a tiny lse error pass
    check_decode_close(ref_out.bfloat16(), ref_lse * (1 + 4 / 65536), ref_out, ref_lse)
    bad = ref_out.clone()
    bad[0, 0, 0, 0] += 0.05 + 0.02 * abs(bad[0, 0, 0, 0])  # beyond 1e-3 + 2.01/128 |ref|
    with pytest.raises(AssertionError, match="out"):
        check_decode_close(bad, ref_lse, ref_out, ref_lse)
    with pytest.raises(AssertionError, match="lse"):
        check_decode_close(ref_out, ref_lse * (1 + 16 / 65536), ref_out, ref_lse)
    lse_fin = ref_lse.clone()
    lse_fin[1, 2, 0] = 3.0  # +inf must stay +inf
    with pytest.raises(AssertionError, match=r"lse: \+inf"):
        check_decode_close(ref_out, lse_fin, ref_out, ref_lse)
    nan_out = ref_out.clone()
    nan_out[0, 0, 1, 7] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        check_decode_close(nan_out, ref_lse, ref_out, ref_lse)
    # within elementwise tolerance everywhere but systematically off: the cosine check fires
    drift = ref_out * (1 + 0.012 * torch.sign(torch.randn(ref_out.shape, generator=g)))
    with pytest.raises(AssertionError, match="cosine"):
        check_decode_close(drift, ref_lse, ref_out, ref_lse)
    with pytest.raises(AssertionError, match="shape"):
        check_decode_close(ref_out[:1], ref_lse, ref_out, ref_lse)


@pytest.mark.parametrize("scale", [1e4, 1e6, 1e30])
def test_huge_scores_give_the_top_keys_value(scale):
    # scores of |s| ~ 1e5 and more: the weights come from exp(s - max) (exp(s - lse) with an fp32 lse
    # was off by ~0.2 at 1e6: lse = max + ln 2 rounds to a quarter); one key, listed twice, carries
    # the whole softmax, so out is its value row
    from sparse_mla.decode.reference import gather_kv
    from sparse_mla.prefill.reference import sparse_prefill_reference

    p = make_problem(b=2, s_q=1, h_q=1, topk=128, num_blocks=4, seed=41)
    p.indices[..., 64:] = p.indices[..., :64]  # every key twice: the top weight is 1/2 + 1/2
    q = (p.q.float() * scale).to(torch.bfloat16)
    out, lse = sparse_decode_reference(q, p.k_cache, p.indices, None, 512)
    k, valid = gather_kv(p.k_cache, p.indices)
    s = torch.einsum("bshd,bstd->bsht", q.float(), k).masked_fill(~valid.unsqueeze(2), float("-inf"))
    top = s.argmax(-1)  # [b, s_q, h]
    want = torch.gather(k[..., :512], 2, top[..., None].expand(-1, -1, -1, 512))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # the prefill twin: the same weights
    o2, _, _ = sparse_prefill_reference(q[:, 0], p.k_cache, p.indices[:, 0][:, None], 576**-0.5)
    torch.testing.assert_close(o2, want[:, 0], rtol=1e-6, atol=1e-6)
