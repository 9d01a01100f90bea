"""fp32 PyTorch reference of the sparse prefill (the test oracle).

Semantics (FlashMLA 1.0's ``flash_mla_sparse_fwd``): query token ``i`` attends the rows
``indices[i, 0, :topk_length[i]]`` of ``kv`` that are valid (``0 <= idx < s_kv``; for an FP8 paged
cache, ``< num_blocks * page_block_size`` slots); scores ``P = q·k · sm_scale``;
``max_logits = max P`` and ``lse = logsumexp P`` (natural log) over the valid keys; ``out =
softmax(P) · k[:, :d_v]``, then times ``exp(lse) / (exp(lse) + exp(sink))`` when ``attn_sink`` is
given (lse and max_logits unchanged). A query head with no valid key gets out 0, lse +inf,
max_logits -inf. Invalid keys are never read, so NaN in unattended rows cannot reach the output.
Non-finite scores follow the decode contract: a NaN or ``+inf`` score on a valid key makes out and
lse NaN; max_logits is then ``+inf`` when some valid score is ``+inf``, else NaN
(:func:`max_logits_rule`: what the kernels' running max gives without tracking NaN per block).
"""

from __future__ import annotations

import torch

from ..decode.reference import gather_kv, poisoned_rows, softmax_weights

__all__ = ["gather_prefill_keys", "selected_keys", "sparse_prefill_reference"]


def selected_keys(
    indices: torch.Tensor, topk_length: torch.Tensor | None, s_kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [s_q, topk] int64, valid [s_q, topk] bool)`` of ``indices [s_q, 1, topk]`` over
    ``s_kv`` rows: an entry is valid when ``0 <= idx < s_kv`` and its position is below
    ``topk_length`` (clamped to ``[0, topk]``); invalid entries get row 0 (to be masked, never
    read unmasked)."""
    idx = indices[:, 0, :].long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        pos = torch.arange(idx.shape[-1], device=idx.device)
        valid &= pos.view(1, -1) < topk_length.to(idx.device).long().view(-1, 1)
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def gather_prefill_keys(
    kv: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None, kv_fp8: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k [s_q, topk, d_qk] float32, valid [s_q, topk] bool)``: the indexed rows (dequantised
    from an FP8 cache), 0 where invalid (never read)."""
    if kv_fp8:  # the decode gather with b = s_q requests of one query token each
        k, valid = gather_kv(kv, indices, topk_length)
        return k[:, 0], valid[:, 0]
    rows, valid = selected_keys(indices, topk_length, kv.shape[0])
    if kv.shape[0] == 0:
        return torch.zeros(*rows.shape, kv.shape[-1], dtype=torch.float32, device=rows.device), valid
    k = kv[:, 0, :][rows].float()
    return torch.where(valid.unsqueeze(-1), k, torch.zeros((), device=k.device)), valid


def max_logits_rule(s: torch.Tensor) -> torch.Tensor:
    """``max_logits`` of scores ``s [..., t]`` (``-inf`` on invalid keys): the max over the keys;
    ``-inf`` for no valid key; with non-finite scores ``+inf`` when one is ``+inf``, else NaN when
    one is NaN (``+inf`` wins over NaN: a kernel's running max skips NaN, and a NaN score shows
    only through the softmax sum, which ``+inf`` turns NaN as well)."""
    if not s.shape[-1]:
        return torch.full(s.shape[:-1], float("-inf"), device=s.device)
    m = s.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")).amax(dim=-1)
    nan = torch.isnan(s).any(dim=-1) & (m != float("inf"))
    return torch.where(nan, torch.full_like(m, float("nan")), m)


def sparse_prefill_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct fp32 sparse prefill.

    Args:
        q: ``[s_q, h_q, d_qk]`` (bf16; computed in fp32).
        kv: ``[s_kv, 1, d_qk]`` bf16, or an FP8 paged cache ``[num_blocks, page_block_size, 1,
            656 | 584]`` (float8_e4m3fn or uint8).
        indices: ``[s_q, 1, topk]`` int32 rows of ``kv`` (cache slots for the FP8 form).
        sm_scale: softmax scale.
        d_v: value dims (512).
        attn_sink: ``[h_q]`` fp32 or None.
        topk_length: ``[s_q]`` int32 or None.

    Returns:
        ``out [s_q, h_q, d_v]``, ``max_logits [s_q, h_q]``, ``lse [s_q, h_q]``, all float32.
    """
    kv_fp8 = kv.dtype in (torch.float8_e4m3fn, torch.uint8)
    k, valid = gather_prefill_keys(kv, indices, topk_length, kv_fp8)
    s = torch.einsum("shd,std->sht", q.float(), k) * sm_scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    max_logits = max_logits_rule(s)
    lse = torch.logsumexp(s, dim=-1)
    lse = torch.where(poisoned_rows(s), torch.full_like(lse, float("nan")), lse)
    lonely = torch.isneginf(lse)
    out = torch.einsum("sht,std->shd", softmax_weights(s), k[..., :d_v])
    lse = torch.where(lonely, torch.full_like(lse, float("inf")), lse)
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink.float().to(lse.device)).unsqueeze(-1)
    out = torch.where(lonely.unsqueeze(-1), torch.zeros_like(out), out)
    return out, max_logits, lse
