"""Gradients of the sparse prefill (``flash_mla_sparse_fwd`` with ``q``/``kv``/``attn_sink``
requiring grad): the hand-written backward twin against autograd through the float64 forward twin
and against finite differences (``gradcheck``), the backward kernel (compiled on CUDA, interpreted
on the CPU) against the twin on random inputs and the contract's corner cases, the whole call
against float64 autograd, ``torch.compile``, the custom op, and the FP8 cache refusing gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import random_latent_k, triton_interpret_enabled

import sparse_mla as flash_mla
from sparse_mla.training.backends import run_prefill_backward
from sparse_mla.training.problem import validate_prefill_backward
from sparse_mla.training.reference import sparse_attention_twin, sparse_prefill_backward_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
#: the kernel against the fp32 twin, relative to the largest gradient: the interpreter's products
#: take fp32 operands; a GPU's take bf16 ones (P and dS rounded to bf16, as FlashAttention's
#: backward does), 0.1-0.3 % off on the H100
KERNEL_TOL = 1e-2 if ON_GPU else 1e-5
needs_kernels = pytest.mark.skipif(not (ON_GPU or triton_interpret_enabled()), reason="needs CUDA or the interpreter")


def make_case(s_q, h_q, topk, d_qk=576, s_kv=48, seed=0, sink=False, topk_length=None, dup=False):
    """``(q, kv, indices, attn_sink, topk_length)`` on DEVICE: bf16 q (a quarter of unit scale) and
    latent rows, indices with -1 and out-of-range entries mixed in (``dup``: repeats inside rows)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(s_q, h_q, d_qk, generator=g) / 4).to(torch.bfloat16)
    kv = random_latent_k(1, s_kv, d_qk, seed).view(s_kv, 1, d_qk)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    bad = torch.rand(s_q, 1, topk, generator=g) < 0.15
    idx = torch.where(bad, torch.tensor([-1, s_kv, s_kv + 7, -5], dtype=torch.int32)[torch.arange(topk) % 4], idx)
    if dup:
        idx[:, :, 1::3] = idx[:, :, 0:1]
    s = torch.randn(h_q, generator=g) if sink else None
    tl = None if topk_length is None else torch.tensor(topk_length, dtype=torch.int32)
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return to(q), to(kv), to(idx), to(s), to(tl)


def twin_grads(q, kv, idx, sm_scale, sink, tl, dout):
    """``(out, lse, dq, dkv, dsink)`` by autograd through the float64 forward twin."""
    q64, kv64 = q.detach().double().requires_grad_(), kv.detach().double().requires_grad_()
    s64 = None if sink is None else sink.detach().double().requires_grad_()
    out, lse = sparse_attention_twin(q64, kv64, idx, sm_scale, 512, s64, tl)
    ins = [q64, kv64] + ([s64] if s64 is not None else [])
    grads = torch.autograd.grad(out, ins, dout.double())
    return out.detach(), lse.detach(), grads[0], grads[1], (grads[2] if s64 is not None else None)


def assert_close(got, want, rel, name):
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - want).abs().max().item()
    bound = rel * max(want.abs().max().item(), 1e-3)
    assert err <= bound, f"{name}: max |Δ| {err:.3g} > {bound:.3g}"


# ------------------------------------------------------------------------- the twins


CASES = {
    "random": dict(),
    "sink": dict(sink=True),
    "duplicates": dict(dup=True, sink=True),
    "topk_length": dict(topk_length=[0, 5, 40, 17]),
}


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_twin_matches_autograd_of_the_forward_twin(case, d_qk):
    q, kv, idx, sink, tl = make_case(4, 3, 24, d_qk, seed=1, **CASES[case])
    scale = d_qk**-0.5
    dout = torch.randn(4, 3, 512, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    out, lse, dq, dkv, dsink = twin_grads(q, kv, idx, scale, sink, tl, dout)
    gq, gkv, gs = sparse_prefill_backward_reference(q, kv, idx, scale, out, lse, dout, sink, tl, dtype=torch.float64)
    assert torch.allclose(gq, dq, rtol=1e-9, atol=1e-12)
    assert torch.allclose(gkv, dkv, rtol=1e-9, atol=1e-12)
    if sink is not None:
        assert torch.allclose(gs, dsink, rtol=1e-9, atol=1e-12)
    assert dkv.abs().sum() > 0  # something flowed


class _TwinWithHandBackward(torch.autograd.Function):
    """The forward twin with the hand-written backward twin as its gradient (for gradcheck)."""

    @staticmethod
    def forward(ctx, q, kv, sink, idx, tl, d_v):
        out, lse = sparse_attention_twin(q, kv, idx, 0.7, d_v, sink, tl)
        ctx.save_for_backward(q, kv, sink, idx, out, lse)
        ctx.tl, ctx.d_v = tl, d_v
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, sink, idx, out, lse = ctx.saved_tensors
        dq, dkv, dsink = sparse_prefill_backward_reference(
            q, kv, idx, 0.7, out, lse, dout, sink, ctx.tl, ctx.d_v, dtype=torch.float64
        )
        return dq, dkv, dsink, None, None, None


@pytest.mark.parametrize("sink_kind", ["finite", "plus_inf", "minus_inf"])
def test_gradcheck_of_the_hand_written_backward(sink_kind):
    # tiny shapes (the twins take any d_qk >= d_v): duplicates within and across rows, -1,
    # out-of-range, a row cut by topk_length and a query with no valid key
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(7, 1, 6, generator=g, dtype=torch.float64, requires_grad=True)
    sink = torch.tensor([0.3, -0.8], dtype=torch.float64)
    if sink_kind != "finite":
        sink[0] = float("inf") if sink_kind == "plus_inf" else float("-inf")
    sink.requires_grad_()
    idx = torch.tensor([[[2, 2, 5, -1]], [[0, 9, 2, 6]], [[-1, 7, -3, 8]], [[1, 3, 4, 1]]], dtype=torch.int32)
    tl = torch.tensor([4, 4, 4, 3], dtype=torch.int32)
    f = lambda a, b, c: _TwinWithHandBackward.apply(a, b, c, idx, tl, 4)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, kv, sink), eps=1e-6, atol=1e-7)
    # and autograd through the forward twin itself agrees with finite differences
    g2 = lambda a, b, c: sparse_attention_twin(a, b, idx, 0.7, 4, c, tl)[0]  # noqa: E731
    assert torch.autograd.gradcheck(g2, (q, kv, sink), eps=1e-6, atol=1e-7)


def test_sink_gradient_against_a_finite_difference():
    q, kv, idx, sink, _ = make_case(3, 2, 16, seed=4, sink=True)
    q, kv, sink = q.double(), kv.double(), sink.double()
    dout = torch.randn(3, 2, 512, dtype=torch.float64, device=DEVICE)
    loss = lambda s: (sparse_attention_twin(q, kv, idx, 0.05, 512, s)[0] * dout).sum()  # noqa: E731
    out, lse = sparse_attention_twin(q, kv, idx, 0.05, 512, sink)
    _, _, dsink = sparse_prefill_backward_reference(q, kv, idx, 0.05, out, lse, dout, sink, dtype=torch.float64)
    for h in range(2):
        e = torch.zeros_like(sink)
        e[h] = 1e-6
        fd = (loss(sink + e) - loss(sink - e)) / 2e-6
        assert abs(fd.item() - dsink[h].item()) <= 1e-6 * max(1.0, abs(fd.item()))


# ------------------------------------------------------------------------- the kernel


def kernel_vs_twin(q, kv, idx, scale, sink, tl, seed=5, poison=None):
    out, _, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, scale, attn_sink=sink, topk_length=tl)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16)
    if poison is not None:
        kv = kv.clone()
        kv[poison] = float("nan")
    p = validate_prefill_backward(dout, q, kv, idx, out, lse, scale, sink, tl)
    got = run_prefill_backward(p, "portable")
    want = run_prefill_backward(p, "reference")
    for g, w, name in zip(got, want, ("dq", "dkv", "dsink"), strict=True):
        if w is None:
            assert g is None
            continue
        assert_close(g, w, KERNEL_TOL, name)
    return got


@needs_kernels
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_twin(case, d_qk):
    q, kv, idx, sink, tl = make_case(4, 3, 40, d_qk, seed=2, **CASES[case])
    dq, dkv, _ = kernel_vs_twin(q, kv, idx, d_qk**-0.5, sink, tl)
    assert dq.abs().sum() > 0 and dkv.abs().sum() > 0


@needs_kernels
@pytest.mark.parametrize("d_qk", [576, 512])
def test_kernel_several_head_tiles_and_row_blocks(d_qk):
    """40 heads and 70 listed rows: two ``dq`` programs per token (32-head tiles, the second
    masked past head 40), ``dkv`` programs walking two head steps (the second masked) over 2-3
    row blocks (64 or 32 rows, the last partial), with list lengths that end inside a block."""
    q, kv, idx, sink, tl = make_case(3, 40, 70, d_qk, s_kv=160, seed=11, sink=True, topk_length=[70, 33, 64])
    dq, dkv, _ = kernel_vs_twin(q, kv, idx, d_qk**-0.5, sink, tl)
    assert (dq[:, 32:].abs().sum(dim=-1) > 0).all()  # the second head tile was written


@needs_kernels
def test_kernel_several_head_tiles_and_shared_keys():
    # 20 heads: one 32-head tile with masked heads; every query lists the same 6 rows (atomics
    # from several programs into one row), and a 7th row twice
    q, kv, _, sink, _ = make_case(3, 20, 8, seed=6, sink=True)
    idx = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 6]]] * 3, dtype=torch.int32, device=DEVICE)
    _, dkv, dsink = kernel_vs_twin(q, kv, idx, 0.05, sink, None)
    assert (dkv[:7].abs().sum(dim=-1) > 0).all() and (dkv[7:] == 0).all()
    assert dsink.shape == (20,)


@needs_kernels
def test_kernel_corner_cases():
    # topk_length 0 for every query: nothing flows; NaN in every row nobody attends stays out
    q, kv, idx, sink, _ = make_case(3, 2, 16, seed=7, sink=True)
    tl = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    dq, dkv, dsink = kernel_vs_twin(q, kv, idx, 0.05, sink, tl)
    assert (dq == 0).all() and (dkv == 0).all() and (dsink == 0).all()
    # one query with no valid key (all -1 / out of range), the others fine; unattended rows NaN
    idx = idx.clone()
    idx[1] = torch.tensor([-1, 48, 99, -7] * 4, dtype=torch.int32)
    used = torch.zeros(48, dtype=torch.bool)
    used[idx[idx.ge(0) & idx.lt(48)].long().cpu()] = True
    dq, dkv, dsink = kernel_vs_twin(q, kv, idx, 0.05, sink, None, poison=~used.to(DEVICE))
    assert (dq[1] == 0).all() and dq[0].abs().sum() > 0
    assert torch.isfinite(dkv).all() and (dkv[~used.to(DEVICE)] == 0).all() and torch.isfinite(dsink).all()


@needs_kernels
@pytest.mark.parametrize("sink_value", [float("inf"), float("-inf")])
def test_kernel_infinite_sink(sink_value):
    q, kv, idx, sink, _ = make_case(3, 2, 16, seed=8, sink=True)
    sink[0] = sink_value
    dq, dkv, dsink = kernel_vs_twin(q, kv, idx, 0.05, sink, None)
    assert torch.isfinite(dsink).all() and dsink[0] == 0
    if sink_value == float("inf"):  # head 0's out is 0 whatever q and kv hold
        assert (dq[:, 0] == 0).all()
    else:
        assert dq[:, 0].abs().sum() > 0


# ------------------------------------------------------------------------- the whole call


@pytest.mark.parametrize("backend", [pytest.param("auto", marks=needs_kernels), "reference"])
@pytest.mark.parametrize("d_qk", [576, 512])
def test_flash_mla_sparse_fwd_gradients(backend, d_qk):
    q, kv, idx, sink, tl = make_case(3, 4, 32, d_qk, seed=11, sink=True, dup=True, topk_length=[32, 9, 0])
    scale = d_qk**-0.5
    q, kv, sink = q.requires_grad_(), kv.requires_grad_(), sink.requires_grad_()
    out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, scale, 512, sink, tl, backend=backend)
    assert out.requires_grad and not max_logits.requires_grad and not lse.requires_grad
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    out.backward(dout)
    assert q.grad.dtype == torch.bfloat16 and kv.grad.dtype == torch.bfloat16 and sink.grad.dtype == torch.float32
    _, _, dq, dkv, dsink = twin_grads(q, kv, idx, scale, sink, tl, dout.float())
    # bf16 rounding of out (in D) and of the returned gradients: a few 2^-8 relative
    assert_close(q.grad, dq, 0.02, "dq")
    assert_close(kv.grad, dkv, 0.02, "dkv")
    assert_close(sink.grad, dsink, 0.02, "dsink")
    assert (q.grad[2] == 0).all()  # topk_length 0


def test_inference_calls_stay_off_the_graph():
    q, kv, idx, _, _ = make_case(2, 2, 8, seed=12)
    q.requires_grad_()
    with torch.no_grad():
        out, _, _ = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, backend="reference")
    assert not out.requires_grad
    out, _, _ = flash_mla.flash_mla_sparse_fwd(q.detach(), kv, idx, 0.05, backend="reference")
    assert not out.requires_grad


def test_fp8_cache_refuses_gradients():
    q, kv, idx, _, _ = make_case(2, 2, 8, seed=13, s_kv=64)
    cache = flash_mla.quantize_k_cache(kv.view(1, 64, 1, 576), "V32")
    with pytest.raises(ValueError, match="kv: .*inference-only"):
        flash_mla.flash_mla_sparse_fwd(q.requires_grad_(), cache, idx, 0.05, backend="reference")
    with pytest.raises(ValueError, match="kv: .*inference-only"):  # the operator itself, too
        torch.ops.sparse_mla.sparse_prefill(q, cache, idx, 0.05, 512, None, None, "reference")
    with torch.no_grad():  # inference through the cache still works
        out, _, _ = flash_mla.flash_mla_sparse_fwd(q, cache, idx, 0.05, backend="reference")
    assert out.shape == (2, 2, 512)


def test_backward_op_checks_its_arguments():
    q, kv, idx, _, _ = make_case(2, 2, 8, seed=14)
    out, _, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, backend="reference")
    op = torch.ops.sparse_mla.sparse_prefill_backward
    with pytest.raises(ValueError, match="dout: expected shape"):
        op(out[:, :1], q, kv, idx, out, lse, 0.05, None, None, "reference")
    with pytest.raises(TypeError, match="lse: expected dtype"):
        op(out, q, kv, idx, out, lse.double(), 0.05, None, None, "reference")
    with pytest.raises(ValueError, match="sm_scale"):
        op(out, q, kv, idx, out, lse, -1.0, None, None, "reference")
    dq, dkv, dsink = op(out, q, kv, idx, out, lse, 0.05, None, None, "reference")
    assert dq.shape == q.shape and dkv.shape == kv.shape and (dsink == 0).all()


def test_backward_op_opcheck():
    q, kv, idx, sink, _ = make_case(2, 2, 8, seed=15, sink=True)
    out, _, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, attn_sink=sink, backend="reference")
    res = torch.library.opcheck(
        torch.ops.sparse_mla.sparse_prefill_backward, (out, q, kv, idx, out, lse, 0.05, sink, None, "reference")
    )
    assert all(v == "SUCCESS" for v in res.values()), res


@pytest.mark.parametrize("backend", [pytest.param("auto", marks=needs_kernels), "reference"])
def test_torch_compile_forward_and_backward(backend):
    q, kv, idx, sink, _ = make_case(2, 2, 8, seed=16, sink=True)

    def step(q, kv, sink):
        out, _, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, attn_sink=sink, backend=backend)
        return (out.float() ** 2).sum() + lse.sum().detach()

    leaves = [x.clone().requires_grad_() for x in (q, kv, sink)]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [x.clone().requires_grad_() for x in (q, kv, sink)]
    step(*eager).backward()
    for a, b, name in zip(leaves, eager, ("q", "kv", "sink"), strict=True):
        assert a.grad is not None and a.grad.abs().sum() > 0, name
        assert torch.allclose(a.grad.float(), b.grad.float(), rtol=1e-2, atol=1e-5), name  # atomics: any order
    # the FP8 cache under compile: the library's ValueError when the graph runs
    cache = flash_mla.quantize_k_cache(random_latent_k(1, 64, 576, 0), "V32").to(DEVICE)
    f = lambda q: flash_mla.flash_mla_sparse_fwd(q, cache, idx, 0.05, backend="reference")[0]  # noqa: E731
    with pytest.raises(ValueError, match="inference-only"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q.clone().requires_grad_())
