"""The indexer's training loss (``indexer_kl_loss``): the twin against the definition computed
query by query, the chunked implementation against the twin (values and gradients, dense and
sparse, several block sizes), ``gradcheck``, the sparse stage fed by ``flash_mla_sparse_fwd``'s
``lse``, queries with no key, NaN in unselected rows, and argument validation."""

from __future__ import annotations

import math

import pytest
import torch

import sparse_mla as flash_mla
from sparse_mla.training.reference import indexer_kl_loss_reference

F64 = torch.float64


def make_case(s_q=9, s_kv=13, H=3, D=8, h_q=4, d=16, topk=7, sparse=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    qi = torch.randn(s_q, H, D, generator=g, dtype=F64)
    ki = torch.randn(s_kv, D, generator=g, dtype=F64)
    w = torch.randn(s_q, H, generator=g, dtype=F64)
    q = torch.randn(s_q, h_q, d, generator=g, dtype=F64)
    kv = torch.randn(s_kv, 1, d, generator=g, dtype=F64)
    idx = torch.randint(-1, s_kv + 2, (s_q, 1, topk), generator=g, dtype=torch.int32) if sparse else None
    return qi, ki, w, q, kv, idx


def definition(qi, ki, w, q, kv, scale, idx=None):
    """The loss by its definition, one query at a time, over plain Python lists of entries."""
    s_q, s_kv = q.shape[0], kv.shape[0]
    total, n = 0.0, 0
    for t in range(s_q):
        if idx is None:
            rows = [s for s in range(s_kv) if s <= t + s_kv - s_q]
        else:
            rows = [int(r) for r in idx[t, 0] if 0 <= int(r) < s_kv]
        if not rows:
            continue
        k = kv[rows, 0]
        p = torch.softmax(q[t] @ k.T * scale, dim=-1).sum(dim=0)
        p = p / p.sum()
        scores = (torch.relu(qi[t] @ ki[rows].T) * w[t].unsqueeze(-1)).sum(dim=0)
        total += float((p * (p.log() - torch.log_softmax(scores, dim=-1))).sum())
        n += 1
    return total / max(n, 1)


@pytest.mark.parametrize("sparse", [False, True])
def test_twin_matches_the_definition(sparse):
    qi, ki, w, q, kv, idx = make_case(sparse=sparse, seed=1)
    got = indexer_kl_loss_reference(qi, ki, w, q, kv, 0.3, idx).item()
    assert math.isclose(got, definition(qi, ki, w, q, kv, 0.3, idx), rel_tol=1e-12)
    assert got > 0


@pytest.mark.parametrize("blocks", [(4, 3), (64, 256), (1, 1)])
@pytest.mark.parametrize("sparse", [False, True])
def test_chunked_matches_the_twin(sparse, blocks):
    qi, ki, w, q, kv, idx = make_case(sparse=sparse, seed=2)
    leaves = [x.clone().requires_grad_() for x in (qi, ki, w)]
    ref = indexer_kl_loss_reference(*leaves, q, kv, 0.3, idx)
    want = torch.autograd.grad(ref, leaves)
    got_loss = flash_mla.indexer_kl_loss(*leaves, q, kv, 0.3, idx, block_q=blocks[0], block_kv=blocks[1])
    got = torch.autograd.grad(got_loss, leaves)
    assert got_loss.dtype == F64 and math.isclose(got_loss.item(), ref.item(), rel_tol=1e-10)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
        assert a.abs().sum() > 0


@pytest.mark.parametrize("sparse", [False, True])
def test_gradcheck(sparse):
    qi, ki, w, q, kv, idx = make_case(s_q=5, s_kv=6, H=2, D=4, h_q=2, d=4, topk=5, sparse=sparse, seed=3)
    leaves = [x.clone().requires_grad_() for x in (qi, ki, w)]
    f = lambda a, b, c: flash_mla.indexer_kl_loss(a, b, c, q, kv, 0.5, idx, block_q=2, block_kv=2)  # noqa: E731
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)


def test_topk_length_and_lonely_queries_and_duplicates():
    qi, ki, w, q, kv, idx = make_case(seed=4)
    idx[2, 0] = -1  # query 2: no valid key
    idx[3, 0, :4] = 5  # key 5 listed four times: it counts four times, as in the attention
    tl = torch.tensor([7, 3, 7, 7, 0, 1, 7, 2, 7], dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (qi, ki, w)]
    got = flash_mla.indexer_kl_loss(*leaves, q, kv, 0.3, idx, tl, block_kv=2)
    cut = torch.where(torch.arange(7).view(1, 1, -1) < tl.view(-1, 1, 1), idx, -1)
    assert math.isclose(got.item(), definition(qi, ki, w, q, kv, 0.3, cut), rel_tol=1e-10)
    got.backward()
    assert (leaves[0].grad[[2, 4]] == 0).all() and (leaves[2].grad[[2, 4, 5]] == 0).all()  # no / one key


def test_no_query_with_a_key_gives_zero():
    qi, ki, w, q, kv, _ = make_case(seed=5)
    idx = torch.full((9, 1, 3), -1, dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (qi, ki, w)]
    loss = flash_mla.indexer_kl_loss(*leaves, q, kv, 0.3, idx)
    loss.backward()
    assert loss.item() == 0 and all((x.grad == 0).all() for x in leaves)


def test_nan_in_unselected_rows_reaches_nothing():
    qi, ki, w, q, kv, idx = make_case(seed=6)
    used = torch.zeros(13, dtype=torch.bool)
    used[idx[(idx >= 0) & (idx < 13)].long()] = True
    ki_bad, kv_bad = ki.clone(), kv.clone()
    ki_bad[~used], kv_bad[~used] = float("nan"), float("nan")
    leaves = [x.clone().requires_grad_() for x in (qi, ki_bad, w)]
    loss = flash_mla.indexer_kl_loss(*leaves, q, kv_bad, 0.3, idx, block_kv=3)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(x.grad).all() for x in leaves)
    assert (leaves[1].grad[~used] == 0).all()
    assert math.isclose(loss.item(), definition(qi, ki, w, q, kv, 0.3, idx), rel_tol=1e-10)


def test_sparse_stage_with_the_forwards_lse():
    # the main attention through flash_mla_sparse_fwd (bf16, the reference backend: no kernel
    # needed), its lse fed to the loss; the indexer inputs fp32 / bf16, as a model holds them
    g = torch.Generator().manual_seed(7)
    s_q, s_kv, h_q, topk = 6, 40, 4, 16
    q = (torch.randn(s_q, h_q, 576, generator=g) / 4).bfloat16()
    kv = (torch.randn(s_kv, 1, 576, generator=g) / 4).bfloat16()
    idx = torch.randint(-1, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    _, _, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 576**-0.5, backend="reference")
    qi = torch.randn(s_q, 4, 32, generator=g).bfloat16().requires_grad_()
    ki = torch.randn(s_kv, 32, generator=g).bfloat16().requires_grad_()
    w = torch.rand(s_q, 4, generator=g).requires_grad_()
    loss = flash_mla.indexer_kl_loss(qi, ki, w, q, kv, 576**-0.5, idx, lse=lse, block_kv=8)
    loss.backward()
    assert loss.dtype == torch.float32 and qi.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    want = definition(*(x.detach().double() for x in (qi, ki, w, q, kv)), 576**-0.5, idx)
    assert math.isclose(loss.item(), want, rel_tol=1e-4, abs_tol=1e-6)
    leaves = [x.detach().double().requires_grad_() for x in (qi, ki, w)]
    ref = indexer_kl_loss_reference(*leaves, q.double(), kv.double(), 576**-0.5, idx)
    for got, want_g in zip((qi.grad, ki.grad, w.grad), torch.autograd.grad(ref, leaves), strict=True):
        err = (got.double() - want_g).abs().max().item()
        assert err <= 0.02 * want_g.abs().max().item() + 1e-6  # bf16 gradients


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(q_idx=torch.zeros(9, 3, 8, dtype=torch.int32)), TypeError, "q_idx: expected dtype"),
        (dict(k_idx=torch.zeros(13, 5, dtype=F64)), ValueError, "k_idx: expected shape"),
        (dict(weights=torch.zeros(9, 2, dtype=F64)), ValueError, r"weights: expected shape .* \(s_q and H of q_idx\)"),
        (dict(kv=torch.zeros(12, 1, 16, dtype=F64)), ValueError, r"kv: expected shape .* \(s_kv of k_idx, d_qk of q\)"),
        (dict(sm_scale=float("nan")), ValueError, "sm_scale"),
        (dict(indices=torch.zeros(9, 7, dtype=torch.int32)), ValueError, "indices: expected a 3-D"),
        (dict(indices=None, topk_length=torch.zeros(9, dtype=torch.int32)), ValueError, "topk_length: only"),
        (dict(lse=torch.zeros(9, 3)), ValueError, "lse: expected shape"),
        (dict(block_kv=0), ValueError, "block_kv"),
        (dict(block_q=1.5), TypeError, "block_q: expected an int"),
        (dict(block_kv="64"), TypeError, "block_kv: expected an int"),
    ],
)
def test_argument_errors(change, error, match):
    qi, ki, w, q, kv, idx = make_case()
    args = dict(q_idx=qi, k_idx=ki, weights=w, q=q, kv=kv, sm_scale=0.3, indices=idx)
    args.update(change)
    with pytest.raises(error, match=match):
        flash_mla.indexer_kl_loss(**args)
