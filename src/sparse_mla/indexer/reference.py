"""PyTorch twins of the indexer kernels (the test oracles; the contract in sparse_mla.indexer).

* :func:`indexer_k_quant_and_cache_reference`: per token, ``amax = max(|k|, 1e-4)``; ``scale =
  amax / 448`` (``scale_fmt=None``) or its power-of-two ceiling ``2^ceil(log2(amax / 448))``
  (``"ue8m0"``, as DeepSeek-V3.2); the token's ``head_dim`` values ``k / scale`` clamped to ±448
  and rounded to e4m3 (nearest even) are written with the fp32 scale into the block-major cache.
  A key with a NaN or inf value is stored as NaN (bytes 0x7F, scale NaN), so its logits are NaN.
* :func:`fp8_mqa_logits_reference`: ``logits[i, j] = kv_scale[j] · Σ_h weights[i, h] · relu(q[i, h] ·
  kv[j])`` for ``ks[i] <= j < ke[i]``, ``-inf`` elsewhere: the model's order (DeepSeek-V3.2's formula, DeepGEMM's),
  equal to ``Σ_h weights[i, h] · relu(q[i, h] · kv[j] · kv_scale[j])`` for every finite scale ``>= 0`` (all
  that the quantiser writes); for a negative or infinite scale the scale-outside order holds.
* :func:`fp8_paged_mqa_logits_reference`: the same over the paged cache; query position ``p`` of
  request ``i`` sees keys ``j < context_lens[i]`` with ``j <= context_lens[i] - next_n + p``.
* :func:`topk_indices_reference`: the ``k`` best positions of each row's valid range.
"""

from __future__ import annotations

import torch

from ..formats.quant import pow2_ceil

__all__ = [
    "indexer_k_quant_and_cache_reference",
    "quantize_index_keys",
    "dequantize_indexer_cache",
    "fp8_mqa_logits_reference",
    "fp8_paged_mqa_logits_reference",
    "topk_indices_reference",
]

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def quantize_index_keys(k: torch.Tensor, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [n, D]`` -> ``(e4m3 bytes [n, D] uint8, scales [n] fp32)``."""
    x = k.float()
    amax = x.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    if scale_fmt == "ue8m0":
        scale = pow2_ceil(amax / FP8_MAX)  # the floor is on amax here, not on amax / 448 as in ue8m0_scale
    else:
        # a tensor divisor: CUDA divides a tensor by a Python number as a product with its
        # reciprocal (not correctly rounded: 5.3405765e-05 for 49/2048/448 = 7·2^-17 on the H200)
        scale = amax / torch.full_like(amax, FP8_MAX)
    q = torch.clamp(x / scale.unsqueeze(-1), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    # a key with a NaN or inf value is stored as NaN (every byte e4m3 NaN, scale NaN): its logits are NaN
    bad = ~torch.isfinite(x).all(dim=-1)
    q = torch.where(bad.unsqueeze(-1), torch.full_like(q, 0x7F), q)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return q, scale


def _split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a block-major cache: ``(data [nb, bs, D] uint8, scales [nb, bs] fp32 bytes as uint8 [nb, bs, 4])``."""
    nb, bs, _, last = kv_cache.shape
    d = last - 4
    stride = kv_cache.stride(0) if nb > 1 else bs * last
    flat = kv_cache.as_strided((nb, bs * last), (stride, 1))
    return flat[:, : bs * d].view(nb, bs, d), flat[:, bs * d : bs * last].view(nb, bs, 4)


def indexer_k_quant_and_cache_reference(
    k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_fmt: str | None = "ue8m0"
) -> None:
    """Quantise ``k [n, D]`` and write it in place at ``slot_mapping`` (slots outside the cache skipped)."""
    nb, bs = kv_cache.shape[:2]
    data, scales = _split_cache(kv_cache)
    slots = slot_mapping.long().to(kv_cache.device)
    ok = (slots >= 0) & (slots < nb * bs)
    if not bool(ok.any()):
        return
    q, scale = quantize_index_keys(k[ok.to(k.device)], scale_fmt)
    s = slots[ok]
    blk, off = s // bs, s % bs
    data[blk, off] = q.to(kv_cache.device)
    scales[blk, off] = scale.to(kv_cache.device).view(torch.uint8).view(-1, 4)


def dequantize_indexer_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys [num_blocks * block_size, D] fp32 e4m3 values, scales [num_blocks * block_size] fp32)``."""
    data, scales = _split_cache(kv_cache)
    d = data.shape[-1]
    keys = data.reshape(-1, d).view(torch.float8_e4m3fn).float()
    return keys, scales.reshape(-1, 4).contiguous().view(torch.float32).reshape(-1)


def _weighted_relu(scores: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``scale[.., j] · Σ_h w[.., h] · relu(s[.., h, j])``: scores ``[rows, H, n]`` of the unscaled keys,
    weights ``[rows, H]``, key scales ``[n]`` or ``[rows, n]``."""
    return (torch.relu(scores) * weights.float().unsqueeze(-1)).sum(dim=1) * scales


def fp8_mqa_logits_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
) -> torch.Tensor:
    """``[s_q, s_kv]`` fp32 logits (``-inf`` outside ``[ks[i], ke[i])``)."""
    s = torch.einsum("qhd,kd->qhk", q.float(), kv.float())
    logits = _weighted_relu(s, weights, kv_scale.float())
    j = torch.arange(kv.shape[0], device=q.device)
    inside = (j >= cu_seqlen_ks.long().unsqueeze(1)) & (j < cu_seqlen_ke.long().unsqueeze(1))
    return torch.where(inside, logits, torch.full_like(logits, float("-inf")))


def fp8_paged_mqa_logits_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
) -> torch.Tensor:
    """``[b * next_n, max_context_len]`` fp32 logits over the paged cache (``-inf`` past each query's
    last visible key; a block-table entry outside the cache makes its keys ``-inf``)."""
    b, next_n, h, d = q.shape
    nb, bs = kv_cache.shape[:2]
    keys, scales = dequantize_indexer_cache(kv_cache)
    j = torch.arange(max_context_len, device=q.device)
    page = (j // bs).clamp(max=block_table.shape[1] - 1)
    blk = block_table.long()[:, page]  # [b, max_context_len]
    ok_blk = (blk >= 0) & (blk < nb) & (j // bs < block_table.shape[1])
    slot = torch.where(ok_blk, blk * bs + j % bs, torch.zeros_like(blk))
    s = torch.einsum("bphd,bjd->bphj", q.float(), keys[slot])  # keys [b, L, D]
    sc = scales[slot].repeat_interleave(next_n, dim=0)  # [b * next_n, L]
    logits = _weighted_relu(s.reshape(b * next_n, h, -1), weights, sc).view(b, next_n, -1)
    ctx = context_lens.long().view(b, 1, 1)
    p = torch.arange(next_n, device=q.device).view(1, next_n, 1)
    visible = (j.view(1, 1, -1) < ctx) & (j.view(1, 1, -1) <= ctx - next_n + p) & ok_blk.unsqueeze(1)
    return torch.where(visible, logits, torch.full_like(logits, float("-inf"))).view(b * next_n, -1)


def topk_indices_reference(
    logits: torch.Tensor, k: int, row_starts: torch.Tensor | None = None, row_ends: torch.Tensor | None = None
) -> torch.Tensor:
    """``[rows, k]`` int32: each row's positions in ``[start, end)`` ordered by logit (descending;
    NaN after ``-inf``), ties by position (ascending); ``-1`` past the number of positions."""
    rows, n = logits.shape
    out = torch.full((rows, k), -1, dtype=torch.int32)
    for r in range(rows):
        lo = 0 if row_starts is None else max(int(row_starts[r]), 0)
        hi = n if row_ends is None else min(int(row_ends[r]), n)
        cand = [(float(logits[r, j]), j) for j in range(lo, hi)]
        cand.sort(key=lambda t: (0 if t[0] == t[0] else 1, -t[0] if t[0] == t[0] else 0.0, t[1]))
        for c, (_, j) in enumerate(cand[:k]):
            out[r, c] = j
    return out.to(logits.device)
