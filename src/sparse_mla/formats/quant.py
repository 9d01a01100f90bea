"""Quantise and dequantise the FP8 caches (pure PyTorch, CPU or CUDA; step 4 in docs/design.md).

Scales are UE8M0 (powers of two): ``scale = 2^ceil(log2(max(amax / 448, 1e-4)))`` and the stored
value is ``x / scale`` rounded to e4m3, so dequantisation (``fp8 * scale``) is exact. A NaN or
±inf value is stored as the NaN byte 0x7F; ``amax`` is over the tile's finite values.
"""

from __future__ import annotations

import torch

from .layouts import (
    FP8_E4M3_MAX,
    SCALE_AMAX_FLOOR,
    KVCacheLayout,
    LayoutLike,
    cache_bytes,
    check_quantized_cache,
    get_layout,
)

__all__ = ["pow2_ceil", "ue8m0_scale", "quantize_k_cache", "dequantize_k_cache", "gather_dequant_tokens"]


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2 v)`` for positive float32 ``v``, exactly: ``frexp`` gives ``v = m * 2^e`` with
    ``m`` in [0.5, 1), so ``ceil(log2 v)`` is ``e - 1`` when ``m == 0.5`` (v is a power of two) and
    ``e`` otherwise, with no rounding of a logarithm."""
    m, e = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), torch.where(m == 0.5, e - 1, e))


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale ``2^ceil(log2(max(amax/448, 1e-4)))`` computed exactly (float32)."""
    return pow2_ceil(torch.clamp(amax.float() / FP8_E4M3_MAX, min=SCALE_AMAX_FLOOR))


def _check_cache_input(k: torch.Tensor, lay: KVCacheLayout) -> None:
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"k: expected a torch.Tensor, got {type(k).__name__}")
    if k.dim() != 4 or k.shape[2] != 1 or k.shape[3] != lay.d_qk:
        raise ValueError(
            f"k: expected shape [num_blocks, page_block_size, 1, {lay.d_qk}] for layout {lay.name}, got {list(k.shape)}"
        )
    if not k.is_floating_point() or k.element_size() == 1:
        raise TypeError(f"k: expected a bf16/fp16/fp32 tensor, got {k.dtype}")


def _quantize_nope(nope: torch.Tensor, lay: KVCacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """nope [N, d_nope] float32 -> (fp8 bytes [N, d_nope] uint8, scales [N, num_tiles] float32)."""
    tiles = nope.view(nope.shape[0], lay.num_tiles, lay.tile)
    # a NaN or +-inf value is stored as the e4m3 NaN byte 0x7F (so a token holding one gives NaN
    # scores wherever it is attended, never a finite wrong value); the scale is its tile's finite values'
    finite = torch.isfinite(tiles)
    scale = ue8m0_scale(torch.where(finite, tiles.abs(), 0.0).amax(dim=-1))
    q = torch.clamp(tiles / scale.unsqueeze(-1), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = torch.where(finite, q, float("nan"))
    return q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(nope.shape[0], lay.d_nope), scale


def quantize_k_cache(
    k: torch.Tensor, layout: LayoutLike = "V32", out_dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """Quantise a bf16 latent KV cache into the FP8 paged layout (pure PyTorch, CPU or CUDA).

    Args:
        k: ``[num_blocks, page_block_size, 1, d_qk]`` bf16 (any float dtype), the latent
            ``[nope | rope]`` vectors; ``d_qk`` must match the layout (576 V32, 512 MODEL1).
        layout: ``"V32"``, ``"MODEL1"`` or a :class:`KVCacheLayout`.
        out_dtype: ``torch.float8_e4m3fn`` (FlashMLA) or ``torch.uint8`` (vLLM's pool dtype).

    Returns:
        ``[num_blocks, page_block_size, 1, bytes_per_token]`` tensor of ``out_dtype`` whose bytes
        follow the layout. For MODEL1 it is a strided view with block stride
        ``layout.block_bytes(page_block_size)``.

    Raises:
        TypeError / ValueError: wrong dtype, shape or layout name.
    """
    lay = get_layout(layout)
    _check_cache_input(k, lay)
    if out_dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"out_dtype: expected torch.float8_e4m3fn or torch.uint8, got {out_dtype}")
    nb, pbs = k.shape[0], k.shape[1]
    flat = k.reshape(nb * pbs, lay.d_qk)
    nope_q, scale = _quantize_nope(flat[:, : lay.d_nope].float(), lay)
    rope = flat[:, lay.d_nope :].to(torch.bfloat16).contiguous().view(torch.uint8)  # [N, 128]
    if lay.name == "V32":
        scale_bytes = scale.contiguous().view(torch.uint8)  # [N, 16]
        out = torch.cat([nope_q, scale_bytes, rope], dim=1).view(nb, pbs, 1, lay.bytes_per_token)
    else:
        exp = torch.frexp(scale)[1] - 1 + 127  # scale = 2^(exp-127)
        sc = torch.zeros(nb * pbs, lay.scale_section_bytes, dtype=torch.uint8, device=k.device)
        sc[:, : lay.num_tiles] = exp.to(torch.uint8)
        blk = torch.zeros(nb, lay.block_bytes(pbs), dtype=torch.uint8, device=k.device)
        data = torch.cat([nope_q, rope], dim=1).view(nb, pbs * lay.data_bytes)
        blk[:, : pbs * lay.data_bytes] = data
        blk[:, pbs * lay.data_bytes : pbs * lay.bytes_per_token] = sc.view(nb, pbs * lay.scale_section_bytes)
        out = blk.as_strided(
            (nb, pbs, 1, lay.bytes_per_token), (lay.block_bytes(pbs), lay.bytes_per_token, lay.bytes_per_token, 1)
        )
    return out.view(out_dtype) if out_dtype != torch.uint8 else out


def gather_dequant_tokens(k_cache: torch.Tensor, layout: LayoutLike, token_idx: torch.Tensor) -> torch.Tensor:
    """Dequantise the cache tokens at flat indices ``token_idx`` (``block * page_block_size + offset``).

    ``token_idx`` must already be in range; returns float32 ``[*token_idx.shape, d_qk]``.
    Honours the block stride of ``k_cache`` (a view of a larger pool).
    """
    lay = get_layout(layout)
    raw = cache_bytes(k_cache)
    nb, pbs = raw.shape[0], raw.shape[1]
    sb = raw.stride(0)
    # a flat byte view covering every block, starting at the cache's first byte; a V32 block
    # spans (pbs - 1) token strides + one record (the token stride may exceed 656 B in a pool
    # that interleaves layers per token)
    if lay.name == "V32":
        block_span = (pbs - 1) * raw.stride(1) + lay.bytes_per_token if pbs > 0 else 0
    else:
        # the last byte a MODEL1 block's tokens use is its last scale byte (pbs * 584); the padding
        # after it is never read, and a copy of the cache (clone_preserve_strides) may lack it
        block_span = pbs * lay.bytes_per_token
    span = (nb - 1) * sb + block_span if nb > 0 else 0
    flat = raw.as_strided((span,), (1,))
    idx = token_idx.reshape(-1).long()
    blk, off = idx // pbs, idx % pbs
    base = blk * sb
    if lay.name == "V32":
        tok = base + off * raw.stride(1)
        data = tok.unsqueeze(1) + torch.arange(lay.bytes_per_token, device=idx.device)
        rec = flat[data]  # [N, 656]
        nope8 = rec[:, : lay.d_nope]
        scale = rec[:, lay.scale_offset : lay.scale_offset + 16].contiguous().view(torch.float32)
        rope = rec[:, lay.rope_offset :].contiguous().view(torch.bfloat16)
    else:
        tok = base + off * lay.data_bytes
        rec = flat[tok.unsqueeze(1) + torch.arange(lay.data_bytes, device=idx.device)]
        nope8 = rec[:, : lay.d_nope]
        rope = rec[:, lay.d_nope :].contiguous().view(torch.bfloat16)
        sc_at = base + pbs * lay.data_bytes + off * lay.scale_section_bytes
        e = flat[sc_at.unsqueeze(1) + torch.arange(lay.num_tiles, device=idx.device)].to(torch.int32)
        scale = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=idx.device), e - 127)
    nope = nope8.contiguous().view(torch.float8_e4m3fn).float().view(-1, lay.num_tiles, lay.tile)
    nope = (nope * scale.unsqueeze(-1)).view(-1, lay.d_nope)
    out = torch.cat([nope, rope.float()], dim=1)
    return out.view(*token_idx.shape, lay.d_qk)


def dequantize_k_cache(
    kq: torch.Tensor, layout: LayoutLike = "V32", dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`quantize_k_cache`: ``[num_blocks, page_block_size, 1, d_qk]`` of ``dtype``.

    Dequantisation is exact (power-of-two scales), so bf16 output loses nothing.

    Raises:
        TypeError / ValueError: cache of the wrong dtype, shape or strides for the layout.
    """
    lay = get_layout(layout)
    check_quantized_cache(kq, lay, "kq")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(
            f"dtype: expected a floating torch.dtype of 16 or more bits (e.g. torch.bfloat16), got {dtype!r}"
        )
    nb, pbs = kq.shape[0], kq.shape[1]
    idx = torch.arange(nb * pbs, device=kq.device)
    return gather_dequant_tokens(kq, lay, idx).to(dtype).view(nb, pbs, 1, lay.d_qk)
