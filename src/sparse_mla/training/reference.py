"""PyTorch twins of the training kernels (the tests' oracles; any float dtype, float64 in the tests).

* :func:`sparse_attention_twin`: the sparse prefill written with differentiable PyTorch operations
  (``flash_mla_sparse_fwd``'s contract, without its dtype and head-dim limits), so that autograd
  through it in float64 is the gradient the backward kernel must give.
* :func:`sparse_prefill_backward_reference`: the backward written directly, from what the forward
  returns (``out``, ``lse``), as the kernel computes it: ``D = rowsum(dO ∘ out)``; with the sink
  folded into ``lse' = logaddexp(lse, sink)``, ``P = exp(q·k·sm_scale − lse')`` over the valid keys,
  ``dS = P ∘ (dO·vᵀ − D)``, ``dq = dS·K·sm_scale``, ``dK = dSᵀ·q·sm_scale`` (all ``d_qk`` columns)
  plus ``Pᵀ·dO`` (the first ``d_v``), scattered into the rows of ``kv``; ``dsink = −Σ_t
  sigmoid(sink − lse)·D``.
* :func:`indexer_kl_loss_reference`: the indexer's training loss, every score materialised.

Derivation of the sink terms: ``out = f·Σ_j p_j v_j`` with ``p_j = exp(s_j − lse)`` and ``f =
sigmoid(lse − sink)``. Then ``∂L/∂s_j = f·p_j·(dO·v_j) − f·p_j·f·(dO·Σ p v) = P'_j·(dO·v_j − D)``
with ``P'_j = f·p_j = exp(s_j − logaddexp(lse, sink))`` and ``D = dO·out``: the sink-free backward
with ``lse`` replaced by ``lse'``. And ``∂out/∂sink = −(1 − f)·out``, so ``∂L/∂sink = −(1 − f)·D``
with ``1 − f = sigmoid(sink − lse)``.
"""

from __future__ import annotations

import torch

from ..prefill.reference import selected_keys

__all__ = [
    "sparse_attention_twin",
    "sparse_prefill_backward_reference",
    "indexer_kl_loss_reference",
]


def _gather(rows_of: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``rows_of[rows]`` with invalid entries 0 (a ``where``: no gradient and no NaN reaches them)."""
    if rows_of.shape[0] == 0:
        return torch.zeros(*rows.shape, rows_of.shape[-1], dtype=rows_of.dtype, device=rows_of.device)
    return torch.where(valid.unsqueeze(-1), rows_of[rows], torch.zeros((), dtype=rows_of.dtype, device=rows_of.device))


def sparse_attention_twin(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable sparse prefill in ``q``'s dtype (float64 in the tests).

    Args:
        q: ``[s_q, h_q, d_qk]`` floating (any ``d_qk >= d_v``).
        kv: ``[s_kv, 1, d_qk]``, ``q``'s dtype.
        indices: ``[s_q, 1, topk]`` int32 rows of ``kv``; ``-1`` or outside ``[0, s_kv)`` ignored.
        sm_scale: softmax scale.
        d_v: value dims (the first ``d_v`` columns of each row).
        attn_sink: ``[h_q]`` or None: out scaled by ``sigmoid(lse − sink)``.
        topk_length: ``[s_q]`` int32 or None.

    Returns:
        ``(out [s_q, h_q, d_v], lse [s_q, h_q])`` in ``q``'s dtype; a query with no valid key gets
        out 0 and lse +inf, and gradient 0 everywhere.
    """
    rows, valid = selected_keys(indices, topk_length, kv.shape[0])
    k = _gather(kv[:, 0, :], rows, valid)  # [s_q, topk, d_qk]
    s = torch.einsum("shd,std->sht", q, k) * sm_scale
    s = torch.where(valid.unsqueeze(1), s, torch.full((), float("-inf"), dtype=s.dtype, device=s.device))
    m = s.detach().amax(dim=-1, keepdim=True) if s.shape[-1] else torch.zeros_like(s[..., :1])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    l_sum = e.sum(dim=-1)
    lonely = ~valid.any(dim=-1, keepdim=True).expand_as(l_sum)
    l_safe = torch.where(lonely, torch.ones_like(l_sum), l_sum)
    out = torch.einsum("sht,std->shd", e / l_safe.unsqueeze(-1), k[..., :d_v])
    lse = m.squeeze(-1) + torch.log(l_safe)
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink.to(lse.dtype)).unsqueeze(-1)
    out = torch.where(lonely.unsqueeze(-1), torch.zeros_like(out), out)
    lse = torch.where(lonely, torch.full_like(lse, float("inf")), lse)
    return out, lse


def sparse_prefill_backward_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    d_v: int = 512,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sparse prefill's backward written directly (the kernel's twin), computed in ``dtype``.

    Args:
        q: ``[s_q, h_q, d_qk]``; kv: ``[s_kv, 1, d_qk]`` (any float dtypes; ``d_qk >= d_v``).
        indices: ``[s_q, 1, topk]`` int32 rows of ``kv``; invalid ones ignored.
        sm_scale: softmax scale.
        out: ``[s_q, h_q, d_v]`` the forward's output (after the sink factor).
        lse: ``[s_q, h_q]`` the forward's natural-log logsumexp (without the sink).
        dout: ``[s_q, h_q, d_v]`` the gradient of the loss with respect to ``out``.
        attn_sink: ``[h_q]`` or None. topk_length: ``[s_q]`` int32 or None. d_v: value dims.
        dtype: float32 or float64.

    Returns:
        ``(dq [s_q, h_q, d_qk], dkv [s_kv, 1, d_qk], dsink [h_q] or None)`` in ``dtype``. Rows of
        ``kv`` that no valid entry selects get 0; a key selected several times (by several queries
        or twice by one) gets the sum.
    """
    q, kv, out, lse, dout = (x.to(dtype) for x in (q, kv, out, lse, dout))
    rows, valid = selected_keys(indices, topk_length, kv.shape[0])
    k = _gather(kv[:, 0, :], rows, valid)
    delta = (dout * out).sum(dim=-1)  # [s_q, h_q]
    lonely = torch.isposinf(lse)
    lse_eff = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.to(dtype))
    s = torch.einsum("shd,std->sht", q, k) * sm_scale
    p = torch.where(valid.unsqueeze(1), torch.exp(s - lse_eff.unsqueeze(-1)), torch.zeros((), dtype=dtype))
    dp = torch.einsum("shd,std->sht", dout, k[..., :d_v])
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("sht,std->shd", ds, k) * sm_scale
    dk = torch.einsum("sht,shd->std", ds, q) * sm_scale
    dk[..., :d_v] += torch.einsum("sht,shd->std", p, dout)
    dkv = torch.zeros(kv.shape[0], kv.shape[2], dtype=dtype, device=kv.device)
    dkv.index_add_(0, rows[valid], dk[valid])
    dsink = None
    if attn_sink is not None:
        w = torch.sigmoid(attn_sink.to(dtype) - lse)
        dsink = -torch.where(lonely, torch.zeros_like(w), w * delta).sum(dim=0)
    return dq, dkv.unsqueeze(1), dsink


def indexer_kl_loss_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    sm_scale: float,
    indices: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """The indexer's KL loss with every score materialised, differentiable in ``q_idx``, ``k_idx``
    and ``weights`` (the target is computed without gradient), in ``q_idx``'s dtype. Contract:
    :func:`sparse_mla.training.indexer_kl_loss`."""
    dtype = q_idx.dtype
    s_q, s_kv = q.shape[0], kv.shape[0]
    if indices is None:  # dense, causal (aligned to the end: query t sees s <= t + s_kv - s_q)
        rows = torch.arange(s_kv, device=q.device).expand(s_q, s_kv)
        valid = rows <= torch.arange(s_q, device=q.device).view(-1, 1) + (s_kv - s_q)
    else:
        rows, valid = selected_keys(indices, topk_length, s_kv)
    neg = torch.full((), float("-inf"), dtype=dtype, device=q.device)
    with torch.no_grad():
        k = _gather(kv[:, 0, :].to(dtype), rows, valid)
        a = torch.einsum("shd,sed->she", q.to(dtype), k) * sm_scale
        a = torch.where(valid.unsqueeze(1), a, neg)
        has = valid.any(dim=-1)
        probs = torch.softmax(torch.where(has.view(-1, 1, 1), a, torch.zeros_like(a)), dim=-1)
        p = torch.where(valid.unsqueeze(1), probs, torch.zeros_like(probs)).sum(dim=1)
        p = p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    ki = _gather(k_idx.to(dtype), rows, valid)  # [s_q, e, D]
    z = torch.einsum("sjd,sed->sje", q_idx.to(dtype), ki)
    scores = (torch.relu(z) * weights.to(dtype).unsqueeze(-1)).sum(dim=1)
    scores = torch.where(valid, scores, neg)
    logq = torch.log_softmax(torch.where(has.view(-1, 1), scores, torch.zeros_like(scores)), dim=-1)
    terms = torch.where(valid, torch.xlogy(p, p) - p * torch.where(valid, logq, torch.zeros_like(logq)), 0.0)
    per_query = terms.sum(dim=-1)
    n = has.sum()
    return torch.where(has, per_query, torch.zeros_like(per_query)).sum() / n.clamp_min(1).to(dtype)
