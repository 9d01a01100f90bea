"""Sparse prefill (``flash_mla_sparse_fwd``): the reference against the definition, the kernels
against the reference (``auto``: the Hopper kernel on an sm_90 GPU, else the portable one,
compiled on CUDA, interpreted on the CPU) on fresh random inputs and the contract's corner
cases, both ``kv`` forms (bf16 rows, the FP8 paged cache), views, and argument validation."""

from __future__ import annotations

import math

import pytest
import torch
from cache_bytes import poison_slots, storage_bytes
from helpers import ON_HOPPER, cache_to, make_cache, random_latent_k, triton_interpret_enabled

import sparse_mla as flash_mla
from sparse_mla.prefill.reference import sparse_prefill_reference
from sparse_mla.testing import check_prefill_close

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS = ON_GPU or triton_interpret_enabled()
needs_kernels = pytest.mark.skipif(not KERNELS, reason="kernels need CUDA or TRITON_INTERPRET=1")
LAYOUT = {576: "V32", 512: "MODEL1"}
#: (form, d_qk) of every kv the call takes: bf16 rows of either width, the V32 and the MODEL1 cache
KV_FORMS = [
    pytest.param("bf16", 576, id="bf16"),
    pytest.param("bf16", 512, id="bf16_512"),
    pytest.param("fp8", 576, id="fp8"),
    pytest.param("fp8", 512, id="fp8_model1"),
]


def make_case(
    s_q,
    h_q,
    topk,
    d_qk=576,
    form="bf16",
    s_kv=300,
    pbs=64,
    seed=0,
    invalid_frac=0.1,
    topk_length=None,
    sink=False,
):
    """Random prefill inputs on DEVICE: ``(q, kv, indices, kwargs)``; indices are distinct valid
    rows with some ``-1`` and out-of-range entries mixed in."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=g).to(torch.bfloat16)
    if form == "bf16":
        kv = random_latent_k(1, s_kv, d_qk, seed).view(s_kv, 1, d_qk)
        n_rows = s_kv
    else:
        nb = -(-s_kv // pbs)
        _, kv = make_cache(LAYOUT[d_qk], nb, pbs, seed)
        n_rows = nb * pbs
    idx = torch.stack([torch.randperm(n_rows, generator=g)[:topk] for _ in range(s_q)] or [torch.zeros(0)]).int()
    idx = idx[:s_q]
    if idx.shape[1] < topk:  # s_kv < topk: pad with -1
        idx = torch.cat([idx, torch.full((s_q, topk - idx.shape[1]), -1, dtype=torch.int32)], dim=1)
    bad = torch.rand(s_q, topk, generator=g) < invalid_frac
    oob = torch.rand(s_q, topk, generator=g) < 0.5
    idx = torch.where(bad & oob, n_rows + 3, torch.where(bad, -1, idx)).int().view(s_q, 1, topk)
    kw = {}
    if topk_length is not None:
        kw["topk_length"] = torch.tensor(topk_length, dtype=torch.int32, device=DEVICE)
    if sink:
        s = torch.randn(h_q, generator=g)
        s[:1] = float("inf")
        s[1:2] = float("-inf")
        kw["attn_sink"] = s.to(DEVICE)
    kv = kv.to(DEVICE) if form == "bf16" else cache_to(kv, DEVICE)
    return q.to(DEVICE), kv, idx.to(DEVICE), kw


def run_and_check(q, kv, idx, backend="auto", finite=True, **kw):
    sm_scale = q.shape[-1] ** -0.5
    out, ml, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, sm_scale, backend=backend, **kw)
    assert out.dtype == torch.bfloat16 and ml.dtype == lse.dtype == torch.float32
    assert out.shape == (q.shape[0], q.shape[1], 512) and ml.shape == lse.shape == q.shape[:2]
    ro, rm, rl = sparse_prefill_reference(q, kv, idx, sm_scale, **kw)
    check_prefill_close(out, ml, lse, ro, rm, rl, finite=finite)
    return out, ml, lse


# ------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize("form", ["bf16", "fp8"])
def test_reference_matches_the_definition(form):
    # one query at a time, one key at a time, in float64: the contract written out
    q, kv, idx, kw = make_case(3, 4, 40, form=form, s_kv=70, seed=1, topk_length=[40, 7, 0], sink=True)
    q, idx = q.cpu(), idx.cpu()
    kw = {k: v.cpu() for k, v in kw.items()}
    kv = kv.cpu() if form == "bf16" else cache_to(kv, "cpu")
    rows = kv[:, 0].double() if form == "bf16" else flash_mla.dequantize_k_cache(kv, "V32").reshape(-1, 576).double()
    scale = 576**-0.5
    out, ml, lse = sparse_prefill_reference(q, kv, idx, scale, **kw)
    for i in range(3):
        keys = [int(t) for t in idx[i, 0, : int(kw["topk_length"][i])] if 0 <= int(t) < rows.shape[0]]
        for h in range(4):
            if not keys:
                assert out[i, h].abs().max() == 0 and math.isinf(lse[i, h]) and lse[i, h] > 0
                assert math.isinf(ml[i, h]) and ml[i, h] < 0
                continue
            s = torch.stack([q[i, h].double() @ rows[t] * scale for t in keys])
            want_lse = torch.logsumexp(s, 0)
            o = (torch.softmax(s, 0)[:, None] * rows[keys, :512]).sum(0)
            o = o * torch.sigmoid(want_lse - kw["attn_sink"][h].double())
            torch.testing.assert_close(out[i, h].double(), o, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(lse[i, h].double(), want_lse, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(ml[i, h].double(), s.max(), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ the kernel


@needs_kernels
@pytest.mark.parametrize("form", ["bf16", "fp8"])
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q, topk", [(1, 1), (16, 64), (20, 96), (64, 130)])
def test_kernel_matches_reference(form, d_qk, h_q, topk):
    q, kv, idx, kw = make_case(3, h_q, topk, d_qk=d_qk, form=form, s_kv=400, seed=h_q + topk + d_qk)
    run_and_check(q, kv, idx, **kw)


def check_topk_2048(h_q, d_qk, form, s_kv, seed, lens):
    """topk 2048 (V3.2's) on ``s_kv >= 2048`` keys: random distinct indices with 10 % of them -1 or
    out of range, topk_length ``lens`` (query 0's > topk), sink +inf / -inf on heads 0 / 1; the last
    query's 2048 indices all -1."""
    q, kv, idx, kw = make_case(
        len(lens), h_q, 2048, d_qk=d_qk, form=form, s_kv=s_kv, seed=seed, topk_length=lens, sink=True
    )
    idx[-1] = -1
    out, ml, lse = run_and_check(q, kv, idx, **kw)
    # the lonely query: out 0, lse +inf, max_logits -inf, whatever the sink
    assert (out[-1].float() == 0).all() and torch.isposinf(lse[-1]).all() and torch.isneginf(ml[-1]).all()
    # query 0 attends ~1840 keys: finite lse and max_logits, out 0 on head 0 (sink +inf) only
    assert torch.isfinite(lse[0]).all() and torch.isfinite(ml[0]).all() and (out[0, 0].float() == 0).all()
    assert (out[0, 1:].float() != 0).any(dim=-1).all()


@needs_kernels
@pytest.mark.parametrize("form, d_qk", [p for p in KV_FORMS if p.id != "bf16_512"])
def test_topk_2048(form, d_qk):
    # 2 query tokens (the interpreter walks up to 32 steps of 64 indices for each): topk_length > topk,
    # and all indices invalid with a partial last step
    check_topk_2048(16, d_qk, form, s_kv=2100, seed=30 + d_qk, lens=[2100, 1999])


@pytest.mark.gpu
@pytest.mark.parametrize("form, d_qk", KV_FORMS)
def test_topk_2048_at_h_q_128(form, d_qk):
    lens = torch.randint(0, 2300, (64,), generator=torch.Generator().manual_seed(d_qk)).tolist()
    lens[:5] = [2100, 2048, 2047, 1, 0]
    check_topk_2048(128, d_qk, form, s_kv=8192, seed=31 + d_qk, lens=lens)


@needs_kernels
@pytest.mark.parametrize("form, d_qk", KV_FORMS)
def test_h_q_128_topk_length_and_sink(form, d_qk):
    q, kv, idx, kw = make_case(2, 128, 150, d_qk=d_qk, form=form, s_kv=500, seed=3, topk_length=[150, 65], sink=True)
    out, ml, lse = run_and_check(q, kv, idx, **kw)
    assert (out[:, 0].float() == 0).all() and torch.isfinite(lse).all() and torch.isfinite(ml).all()  # sink +inf


@needs_kernels
@pytest.mark.parametrize("form, d_qk", KV_FORMS)
def test_corner_cases(form, d_qk):
    # all indices invalid (query 0), topk_length 0 (query 1), > topk and negative (queries 2, 3),
    # sink +inf / -inf on heads 0 / 1, s_kv smaller than topk
    q, kv, idx, kw = make_case(
        5, 20, 96, d_qk=d_qk, form=form, s_kv=50, pbs=16, seed=4, topk_length=[96, 0, 1000, -3, 50], sink=True
    )
    idx[0] = -1
    out, ml, lse = run_and_check(q, kv, idx, **kw)
    for i in (0, 1, 3):  # lonely: out 0, lse +inf, max_logits -inf, whatever the sink
        assert (out[i].float() == 0).all() and torch.isposinf(lse[i]).all() and torch.isneginf(ml[i]).all()
    assert (out[2, 0].float() == 0).all() and torch.isfinite(lse[2]).all()


def poison_keys(kv, rows):
    """Make the keys at ``rows`` NaN: bf16 rows, or every byte of those cache slots' records
    (:func:`cache_bytes.poison_slots`: NaN FP8 values, RoPE and scales); the rest stays."""
    if kv.dtype == torch.bfloat16:
        kv[rows] = float("nan")
    else:
        poison_slots(kv, rows)


@needs_kernels
@pytest.mark.parametrize("form, d_qk", KV_FORMS)
def test_nan_in_unattended_rows_never_reaches_the_output(form, d_qk):
    q, kv, idx, kw = make_case(3, 16, 64, d_qk=d_qk, form=form, s_kv=256, seed=5, topk_length=[64, 10, 33])
    n_rows = kv.shape[0] if form == "bf16" else kv.shape[0] * kv.shape[1]
    used = torch.zeros(n_rows, dtype=torch.bool, device=DEVICE)
    for i, n in enumerate(kw["topk_length"].tolist()):
        r = idx[i, 0, :n].long()
        used[r[(r >= 0) & (r < n_rows)]] = True
    before = kv.clone() if form == "bf16" else storage_bytes(kv).clone()
    poison_keys(kv, (~used).nonzero()[:, 0])
    # the poison is where it should be, and only there
    if form == "bf16":
        rows, was = kv[:, 0].float().cpu(), before[:, 0].float().cpu()
    else:
        lay = LAYOUT[d_qk]
        rows = flash_mla.dequantize_k_cache(cache_to(kv, "cpu"), lay).reshape(n_rows, d_qk).float()
        was = (
            flash_mla.dequantize_k_cache(
                cache_to(before.as_strided(kv.shape, kv.stride(), kv.storage_offset()), "cpu"), lay
            )
            .reshape(n_rows, d_qk)
            .float()
        )
    assert torch.isnan(rows[~used.cpu()]).all() and torch.equal(rows[used.cpu()], was[used.cpu()])
    # indices past topk_length point at NaN rows
    for i, n in enumerate(kw["topk_length"].tolist()):
        idx[i, 0, n:] = (~used).nonzero()[0, 0].int()
    out, ml, lse = run_and_check(q, kv, idx, **kw)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all() and torch.isfinite(ml).all()


@needs_kernels
def test_fp8_cache_and_its_bf16_rows_agree():
    # the FP8 form on a cache and the bf16 form on its dequantised rows attend the same keys
    q, kc, idx, kw = make_case(4, 24, 100, d_qk=512, form="fp8", s_kv=320, pbs=32, seed=6, sink=True)
    rows = flash_mla.dequantize_k_cache(cache_to(kc, "cpu"), "MODEL1").reshape(-1, 1, 512).to(DEVICE)
    a = flash_mla.flash_mla_sparse_fwd(q, kc, idx, 0.07, **kw)
    b = flash_mla.flash_mla_sparse_fwd(q, rows, idx, 0.07, **kw)
    check_prefill_close(*a, *[t.float() for t in b])


@needs_kernels
@pytest.mark.parametrize("form", ["bf16", "fp8"])
def test_views(form):
    # strided q, a row-strided kv (or a pool view of the cache), transposed indices, expanded
    # topk_length and a strided sink: views are valid tensors
    s_q, h_q, topk = 3, 16, 70
    q, kv, idx, kw = make_case(s_q, h_q, topk, form=form, s_kv=200, pbs=64, seed=7, sink=True)
    big_q = torch.zeros(s_q, 2 * h_q, 640, dtype=torch.bfloat16, device=DEVICE)
    big_q[:, ::2, :576] = q
    qv = big_q[:, ::2, :576]
    if form == "bf16":
        big_kv = torch.zeros(kv.shape[0], 1, 700, dtype=torch.bfloat16, device=DEVICE)
        big_kv[..., 3 : 3 + 576] = kv
        kvv = big_kv[..., 3 : 3 + 576]
    else:
        nb = kv.shape[0]
        pool = torch.zeros(nb + 2, *kv.shape[1:], dtype=kv.dtype, device=DEVICE)
        pool[1 : nb + 1] = kv
        kvv = pool[1 : nb + 1]
    idx_t = idx.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    lens = torch.tensor([50], dtype=torch.int32, device=DEVICE).expand(s_q)
    sink = torch.stack([kw["attn_sink"], kw["attn_sink"]], dim=1)[:, 0]
    out, ml, lse = run_and_check(qv, kvv, idx_t, topk_length=lens, attn_sink=sink)
    ref = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 576**-0.5, topk_length=lens.contiguous(), attn_sink=sink.clone())
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[2]) and torch.equal(ml, ref[1])


def test_auto_runs_the_kernel_where_triton_runs():
    from sparse_mla.prefill import validate_sparse_prefill
    from sparse_mla.prefill.backends import resolve_prefill_backend

    q, kv, idx, _ = make_case(1, 16, 8, seed=14)  # bf16 rows
    want = "hopper" if ON_HOPPER else ("portable" if KERNELS else "reference")
    assert resolve_prefill_backend(validate_sparse_prefill(q, kv, idx, 0.1)) == want


@pytest.mark.skipif(ON_HOPPER, reason="an sm_90 GPU runs both kv forms on the hopper backend")
@pytest.mark.parametrize("form", ["bf16", "fp8"])
def test_hopper_backend_refuses_what_it_cannot_run(form):
    q, kv, idx, _ = make_case(2, 16, 8, form=form, seed=15)
    with pytest.raises(ValueError, match="^backend: the 'hopper' backend cannot serve this call: it needs "):
        flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.1, backend="hopper")


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("form", ["fp8", "bf16"])
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [128, 40, 16, 32])
def test_hopper_backend_on_both_kv_forms(form, d_qk, h_q):
    # fp8: the cache producer; bf16 rows: the KV_BF16 producer (cp.async into the K stages)
    from sparse_mla.prefill import validate_sparse_prefill
    from sparse_mla.prefill.backends import resolve_prefill_backend

    # 9 query tokens: the kernel rounds P to bf16 (as FlashMLA's do); at 37 tokens x 128 heads x 512
    # (2.4 M outputs) the tail of that rounding put 4 outputs at 1.1x FlashMLA's prefill tolerance
    lens = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(d_qk + h_q)).tolist()
    lens[:3] = [0, 300, 1]
    q, kv, idx, kw = make_case(9, h_q, 300, d_qk=d_qk, form=form, s_kv=2000, seed=21, topk_length=lens, sink=True)
    assert resolve_prefill_backend(validate_sparse_prefill(q, kv, idx, 0.1)) == "hopper"
    out, ml, lse = run_and_check(q, kv, idx, backend="hopper", **kw)
    assert torch.isposinf(lse[0]).all() and torch.isneginf(ml[0]).all() and (out[0].float() == 0).all()


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize(
    "d_qk, pad, offset, align, h_q",
    [
        (576, 0, 0, 16, 64),
        (576, 4, 0, 8, 64),
        (576, 2, 0, 4, 16),
        (576, 1, 0, 2, 64),
        (576, 8, 3, 2, 32),
        (512, 4, 0, 8, 64),
    ],
)
def test_hopper_bf16_rows_at_every_alignment(d_qk, pad, offset, align, h_q):
    # row views whose addresses are 16-, 8-, 4- or only 2-byte aligned: cp.async of 16, 8 or 4 bytes,
    # or (a 2-byte aligned base or row stride) the register fallback; all give the contiguous rows'
    # result bit for bit, and the NaN around each row is never read
    from sparse_mla.decode.kernels.hopper import rows_alignment

    q, kv, idx, kw = make_case(5, h_q, 200, d_qk=d_qk, s_kv=700, seed=22, topk_length=[200, 0, 17, 64, 130], sink=True)
    big = torch.full((kv.shape[0], 1, d_qk + pad + offset), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    big[..., offset : offset + d_qk] = kv
    kvv = big[..., offset : offset + d_qk]
    assert rows_alignment(kvv) == align
    out, ml, lse = run_and_check(q, kvv, idx, backend="hopper", **kw)
    ref = flash_mla.flash_mla_sparse_fwd(q, kv, idx, d_qk**-0.5, backend="hopper", **kw)
    assert torch.equal(out, ref[0]) and torch.equal(ml, ref[1]) and torch.equal(lse, ref[2])


@needs_kernels
def test_non_finite_queries():
    q, kv, idx, kw = make_case(2, 16, 64, seed=8)
    q[0, 3, 5] = float("nan")
    q[1, 4, :] = float("inf")
    out, ml, lse = run_and_check(q, kv, idx, finite=False, **kw)
    assert torch.isnan(out[0, 3].float()).all() and torch.isnan(lse[0, 3]) and torch.isnan(ml[0, 3])
    assert torch.isfinite(out[0, :3].float()).all() and torch.isfinite(out[1, :4].float()).all()


@needs_kernels
@pytest.mark.parametrize("form", ["bf16", "fp8"])
def test_max_logits_of_inf_and_nan_scores(form):
    # one +inf query value: keys with a positive entry there score +inf, negative -inf, zero NaN
    # (inf * 0). Head 1 sees +inf and NaN scores: max_logits +inf (+inf wins over NaN, as the
    # reference's max_logits_rule says); head 2 has a NaN query value (NaN scores only): NaN; the
    # other heads stay finite
    q, kv, idx, kw = make_case(3, 16, 64, form=form, seed=23, invalid_frac=0.0)
    d0 = 7
    q[:, 1, :] = 0.01
    q[:, 1, d0] = float("inf")
    q[:, 2, 9] = float("nan")
    rows = idx[:, 0, :8].long()  # the first 8 keys of every token: entry d0 zero, positive, negative
    if form == "bf16":  # (the zeros last: a key two tokens share keeps its zero)
        kv[rows[:, 1], 0, d0] = 1.0
        kv[rows[:, 0], 0, d0] = 0.0
    else:  # the FP8 cache: overwrite the NoPE byte of dim d0 (e4m3 0x38 = 1.0, 0x00 = 0)
        from sparse_mla.formats import cache_bytes

        raw = cache_bytes(kv)
        pbs = raw.shape[1]
        for slot, byte in ((rows[:, 1], 0x38), (rows[:, 0], 0x00)):
            raw[slot // pbs, slot % pbs, 0, d0] = byte
    out, ml, lse = run_and_check(q, kv, idx, finite=False, **kw)
    assert torch.isposinf(ml[:, 1]).all() and torch.isnan(lse[:, 1]).all()
    assert torch.isnan(ml[:, 2]).all() and torch.isnan(lse[:, 2]).all()
    assert torch.isfinite(ml[:, 3:]).all() and torch.isfinite(lse[:, 3:]).all()


# ------------------------------------------------------------------------------ the API


def test_empty_and_reference_backend():
    q, kv, idx, _ = make_case(0, 16, 8, seed=9)
    out, ml, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.1)
    assert out.shape == (0, 16, 512) and ml.shape == lse.shape == (0, 16)
    q, kv, idx, kw = make_case(2, 16, 40, seed=10, sink=True)
    run_and_check(q, kv, idx, backend="reference", **kw)
    with pytest.raises(ValueError, match="^backend: expected 'auto' or one of"):
        flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.1, backend="fast")
    with pytest.raises(TypeError, match="^backend"):
        flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.1, backend=1)


def _bad_calls():
    q = torch.randn(2, 16, 576).to(torch.bfloat16)
    kv = torch.randn(30, 1, 576).to(torch.bfloat16)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    _, kc = make_cache("V32", 2, 16, 0)
    ok = dict(q=q, kv=kv, indices=idx, sm_scale=0.1)
    yield "q: expected dtype", TypeError, dict(ok, q=q.float())
    yield "q: expected a 3-D", ValueError, dict(ok, q=q[None])
    yield "q: head dim", ValueError, dict(ok, q=q[..., :500])
    yield r"q: h_q must be in \[1, 128\]", ValueError, dict(ok, q=torch.zeros(2, 129, 576, dtype=torch.bfloat16))
    yield "q: the last dimension", ValueError, dict(ok, q=torch.zeros(2, 576, 16, dtype=torch.bfloat16).transpose(1, 2))
    yield "kv: expected a torch.Tensor", TypeError, dict(ok, kv=[1])
    yield "kv: expected bf16", TypeError, dict(ok, kv=kv.float())
    yield r"kv: expected shape \[s_kv, 1, d_qk=576\]", ValueError, dict(ok, kv=kv.view(15, 2, 576))
    yield r"kv: expected shape \[s_kv, 1, d_qk=576\]", ValueError, dict(ok, kv=kv[..., :512])
    yield (
        "kv: the last dimension",
        ValueError,
        dict(ok, kv=torch.zeros(576, 30, 1, dtype=torch.bfloat16).permute(1, 2, 0)),
    )
    yield "kv: expected shape", ValueError, dict(ok, q=q[..., :512], kv=kc)  # V32 cache for d_qk 512
    yield "indices: expected dtype", TypeError, dict(ok, indices=idx.long())
    yield r"indices: expected shape \[s_q=2, h_kv=1, topk\]", ValueError, dict(ok, indices=idx.view(1, 2, 8))
    yield "indices: topk must be", ValueError, dict(ok, indices=idx[..., :0])
    yield "sm_scale: expected a float", TypeError, dict(ok, sm_scale="0.1")
    yield "sm_scale: expected a finite positive", ValueError, dict(ok, sm_scale=float("nan"))
    yield "sm_scale: expected a finite positive", ValueError, dict(ok, sm_scale=0.0)
    yield "sm_scale: expected a finite positive", ValueError, dict(ok, sm_scale=10**400)  # beyond float64
    yield "d_v: expected 512", ValueError, dict(ok, d_v=576)
    yield "attn_sink: expected dtype", TypeError, dict(ok, attn_sink=torch.zeros(16, dtype=torch.float64))
    yield r"attn_sink: expected shape \[h_q=16\]", ValueError, dict(ok, attn_sink=torch.zeros(15))
    yield "topk_length: expected dtype", TypeError, dict(ok, topk_length=torch.zeros(2))
    yield r"topk_length: expected shape \[s_q=2\]", ValueError, dict(ok, topk_length=torch.zeros(3, dtype=torch.int32))


def _misaligned_cache():
    _, kc = make_cache("V32", 2, 16, 0)
    raw = torch.zeros(1 + kc.numel(), dtype=torch.uint8)
    raw[1:] = kc.view(torch.uint8).flatten()
    return raw[1:].view(2, 16, 1, 656)


def _more_bad_calls():
    q = torch.randn(2, 16, 576).to(torch.bfloat16)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    yield "kv: the V32 layout needs its start", ValueError, dict(q=q, kv=_misaligned_cache(), indices=idx, sm_scale=0.1)
    kv = torch.randn(30, 1, 576).to(torch.bfloat16)
    yield "sm_scale: expected a finite positive float", ValueError, dict(q=q, kv=kv, indices=idx, sm_scale=1e300)
    yield "sm_scale: expected a finite positive float", ValueError, dict(q=q, kv=kv, indices=idx, sm_scale=1e-300)
    yield "sm_scale: expected a float", TypeError, dict(q=q, kv=kv, indices=idx, sm_scale=torch.tensor(0.1))


@pytest.mark.parametrize(
    "match, exc, kwargs", list(_bad_calls()) + list(_more_bad_calls()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_bad_arguments_raise_naming_them(match, exc, kwargs):
    with pytest.raises(exc, match="^" + match):
        flash_mla.flash_mla_sparse_fwd(**kwargs)


# ------------------------------------------------------------------------------ the operator


@pytest.mark.parametrize("form", ["bf16", "fp8"])
def test_operator_opcheck(form):
    q, kv, idx, kw = make_case(2, 16, 40, form=form, s_kv=100, seed=11, topk_length=[40, 9], sink=True)
    if form == "fp8":  # as raw bytes: opcheck's schema check compares inputs with ops fp8 lacks on the CPU
        kv = kv.view(torch.uint8)
    res = torch.library.opcheck(torch.ops.sparse_mla.sparse_prefill.default, (q, kv, idx, 0.05), dict(kw, d_v=512))
    assert all(v == "SUCCESS" for v in res.values()), res


def test_misaligned_cache_is_rejected_by_the_decode_too():
    meta, _ = flash_mla.get_mla_metadata()
    q = torch.randn(1, 1, 16, 576).to(torch.bfloat16)
    with pytest.raises(ValueError, match="^k_cache: the V32 layout needs its start"):
        flash_mla.flash_mla_with_kvcache(
            q,
            _misaligned_cache(),
            None,
            None,
            512,
            meta,
            is_fp8_kvcache=True,
            indices=torch.zeros(1, 1, 8, dtype=torch.int32),
        )


def test_compiled_call_checks_its_python_numbers():
    # the library's own exception when the compiled function runs (before: Dynamo's Unsupported
    # "Observed exception" for the numbers, a TorchRuntimeError "Dynamo failed to run FX node with
    # fake tensors" for q)
    q, kv, idx, _ = make_case(2, 16, 8, seed=15)

    def f(q, kv, idx):
        return flash_mla.flash_mla_sparse_fwd(q, kv, idx, True)[0]

    with pytest.raises(TypeError, match="^sm_scale: expected a float, got bool$"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, kv, idx)
    with pytest.raises(ValueError, match=r"^q: expected a 3-D tensor, got shape \[16, 576\]$"):
        torch.compile(
            lambda q: flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.1)[0], fullgraph=True, backend="aot_eager"
        )(q[0])


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_call_raises_the_librarys_own_errors(dynamic):
    q, kv, idx, _ = make_case(2, 16, 8, seed=17)

    def run(fn, *args):
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)(*args)

    def prefill(q, kv, idx, sm_scale, d_v=512):
        out, _, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, sm_scale, d_v)
        return out.float() * 2, lse

    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite positive float \(as float32\), got -1.0$"):
        run(prefill, q, kv, idx, -1.0)
    with pytest.raises(ValueError, match="^d_v: expected 512, got 256$"):
        run(prefill, q, kv, idx, 0.1, 256)
    with pytest.raises(TypeError, match="^q: expected dtype torch.bfloat16, got torch.float32$"):
        run(prefill, q.float(), kv, idx, 0.1)
    with pytest.raises(ValueError, match=r"^q: h_q must be in \[1, 128\], got shape \[2, 200, 576\]$"):
        run(prefill, q[:, :1].expand(2, 200, 576).contiguous(), kv, idx, 0.1)
    # what the operator checks when it runs (indices' shape) was the library's exception already
    with pytest.raises(ValueError, match=r"^indices: expected shape \[s_q=2, h_kv=1, topk\]"):
        run(prefill, q, kv, idx[:1], 0.1)
    got = run(prefill, q, kv, idx, 0.1)
    assert torch.equal(got[0], prefill(q, kv, idx, 0.1)[0])


def test_only_out_requires_grad():
    # out is differentiable (tests/training/ checks its gradients); max_logits and lse never are,
    # and under no_grad nothing is
    q, kv, idx, _ = make_case(2, 16, 8, seed=16)
    for backend in ("reference",) + (("portable",) if KERNELS else ()):
        out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(q.clone().requires_grad_(), kv, idx, 0.1, backend=backend)
        assert out.requires_grad and not max_logits.requires_grad and not lse.requires_grad
        with torch.no_grad():
            outs = flash_mla.flash_mla_sparse_fwd(q.clone().requires_grad_(), kv, idx, 0.1, backend=backend)
        assert not any(t.requires_grad for t in outs)


def test_torch_compile_fullgraph():
    q, kv, idx, kw = make_case(2, 16, 40, seed=12, sink=True)

    def f(q, kv, idx, sink):
        out, ml, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, attn_sink=sink)
        return out.float() * 2, lse

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, kv, idx, kw["attn_sink"])
    want = f(q, kv, idx, kw["attn_sink"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "form, d_qk, h_q",
    [
        ("fp8", 576, 64),
        ("bf16", 576, 64),
        ("fp8", 576, 16),
        ("bf16", 576, 32),
        ("fp8", 512, 64),
        ("fp8", 512, 16),
        ("bf16", 512, 32),
    ],
)
def test_cuda_graph_capture_and_replay(form, d_qk, h_q):
    q, kv, idx, kw = make_case(
        8, h_q, 256, d_qk=d_qk, form=form, s_kv=2048, seed=13, topk_length=list(range(1, 257, 32)), sink=True
    )
    want = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, **kw)
    q.copy_(q.flip(0))
    g.replay()
    torch.cuda.synchronize()
    again = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, **kw)
    for a, b in zip(got, again, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got[2], want[2])
    check_prefill_close(*got, *sparse_prefill_reference(q, kv, idx, 0.05, **kw))


@pytest.mark.gpu
def test_a_schedule_first_built_in_a_graph_is_not_reused_eagerly():
    # the Hopper route builds its per-shape table on the device; built during capture its values
    # exist only once the graph replays, so it must not serve a later eager call of that shape
    q, kv, idx, kw = make_case(8, 64, 256, form="fp8", s_kv=2048, seed=17)
    flash_mla.flash_mla_sparse_fwd(q[:3], kv, idx[:3], 0.05)  # kernels compiled, another shape
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05)
    g.replay()
    eager = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05)
    torch.cuda.synchronize()
    ro, rm, rl = sparse_prefill_reference(q, kv, idx, 0.05)
    check_prefill_close(*eager, ro, rm, rl)
    check_prefill_close(*got, ro, rm, rl)


def test_bf16_kv_the_kernels_cannot_read_as_stored_is_refused():
    # a lazily negated view (the kernels read the raw bits: the un-negated rows before) and a view
    # whose storage was shrunk under it (read out of bounds before)
    q, kv, idx, _ = make_case(2, 16, 8, seed=17)
    with pytest.raises(ValueError, match="kv: a lazily negated"):
        flash_mla.flash_mla_sparse_fwd(q, torch._neg_view(kv), idx, 0.1)
    shrunk = kv.clone()
    shrunk.untyped_storage().resize_(shrunk.untyped_storage().nbytes() // 2)
    with pytest.raises(ValueError, match="kv: its elements run"):
        flash_mla.flash_mla_sparse_fwd(q, shrunk, idx, 0.1)


@pytest.mark.parametrize(
    "value, ok",
    [(2.0**-149, True), (2.0**-150, False), (3.4028234663852886e38, True), (3.4028235677973366e38, False)],
)
def test_scales_are_checked_at_the_float32_edges(value, ok):
    # the kernels take sm_scale as float32: 2^-150 rounds to 0 and the maximum plus half an ulp to inf
    from sparse_mla.core.checks import check_scale

    if ok:
        assert check_scale(value, "sm_scale") == value
        assert 0 < float(torch.tensor(value, dtype=torch.float32)) < float("inf")
    else:
        with pytest.raises(ValueError, match="sm_scale: expected a finite positive float"):
            check_scale(value, "sm_scale")
