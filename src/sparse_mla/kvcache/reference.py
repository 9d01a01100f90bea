"""PyTorch twins of the serving-path kernels (pure PyTorch, no host synchronisation): the fused
quantise-and-store (:mod:`.store`) and the index conversion (:mod:`.index_convert`).

``abs_indices_to_kvcache_indices`` is also public API (``sparse_mla.abs_indices_to_kvcache_indices``).
"""

from __future__ import annotations

import torch

from ..formats import cache_bytes, layout_of_cache, quantize_k_cache
from .problem import check_abs_index_args

__all__ = ["quantize_and_store_kv_reference", "abs_indices_to_kvcache_indices"]

_INT32_MAX = 2**31 - 1


def quantize_and_store_kv_reference(kv: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
    """PyTorch twin of :func:`sparse_mla.kvcache.store.quantize_and_store_kv`: write ``kv`` in place.

    Each token is quantised with :func:`sparse_mla.kvcache.quantize_k_cache` and its bytes are
    scattered into ``k_cache`` (through its strides): V32 the 656-byte record at
    ``block * stride(0) + offset * stride(1)``; MODEL1 the 576-byte ``[nope | rope]`` record at
    ``block * stride(0) + offset * 576`` and the 8 scale bytes at
    ``block * stride(0) + page_block_size * 576 + offset * 8``. Tokens whose slot is outside
    ``[0, num_blocks * page_block_size)`` (``-1`` included) are skipped.

    Args:
        kv: ``[n, d_qk]`` bf16 (d_qk 576 for a 656-byte cache, 512 for a 584-byte one).
        slot_mapping: ``[n]`` int64/int32 slots.
        k_cache: ``[num_blocks, page_block_size, 1, bytes_per_token]`` fp8/uint8, written in place.
    """
    lay = layout_of_cache(k_cache)
    raw = cache_bytes(k_cache)
    nb, pbs = raw.shape[0], raw.shape[1]
    slots = slot_mapping.long().to(raw.device)
    ok = (slots >= 0) & (slots < nb * pbs)
    if not bool(ok.any()):
        return
    slots = slots[ok]
    toks = kv[ok.to(kv.device)]
    q = quantize_k_cache(toks.view(-1, 1, 1, lay.d_qk), lay, out_dtype=torch.uint8)  # one token per block
    rec = cache_bytes(q).as_strided((q.shape[0], lay.block_bytes(1)), (q.stride(0), 1))
    blk, off = slots // pbs, slots % pbs
    if lay.name == "V32":
        span = (nb - 1) * raw.stride(0) + (pbs - 1) * raw.stride(1) + lay.bytes_per_token
        dst = (blk * raw.stride(0) + off * raw.stride(1)).unsqueeze(1) + torch.arange(
            lay.bytes_per_token, device=raw.device
        )
        src = rec[:, : lay.bytes_per_token]
    else:
        span = (nb - 1) * raw.stride(0) + pbs * lay.bytes_per_token
        base = blk * raw.stride(0)
        ar_d = torch.arange(lay.data_bytes, device=raw.device)
        ar_s = torch.arange(lay.scale_section_bytes, device=raw.device)
        dst = torch.cat(
            [
                (base + off * lay.data_bytes).unsqueeze(1) + ar_d,
                (base + pbs * lay.data_bytes + off * lay.scale_section_bytes).unsqueeze(1) + ar_s,
            ],
            dim=1,
        )
        src = rec[:, : lay.data_bytes + lay.scale_section_bytes]
    flat = raw.as_strided((span,), (1,))
    flat[dst.reshape(-1)] = src.reshape(-1).to(raw.device)


def abs_indices_to_kvcache_indices(
    abs_indices: torch.Tensor, block_table: torch.Tensor, page_block_size: int
) -> torch.Tensor:
    """Turn per-request logical token positions into cache indices (pure PyTorch, no host sync).

    Args:
        abs_indices: ``[b, s_q, topk]`` int32, the logical position of each selected token in its
            request (``-1`` = no token).
        block_table: ``[b, max_blocks_per_seq]`` int32, physical page block of each logical block.
        page_block_size: tokens per page block (> 0).

    Returns:
        ``[b, s_q, topk]`` int32 ``block_table[i, t // page_block_size] * page_block_size +
        t % page_block_size``; ``-1`` where the position is ``-1`` or past int32, outside the
        block table, or maps to a negative block or to a slot past int32.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or ``page_block_size``.
    """
    check_abs_index_args(abs_indices, block_table, page_block_size)
    t = abs_indices.long()
    lb = torch.div(t, page_block_size, rounding_mode="floor")
    nlog = block_table.shape[1]
    ok = (t >= 0) & (t <= _INT32_MAX) & (lb < nlog)
    lb_safe = torch.where(ok, lb, torch.zeros_like(lb)).reshape(t.shape[0], t.shape[1] * t.shape[2])
    phys = torch.gather(block_table.long(), 1, lb_safe).view_as(t) if nlog > 0 else torch.zeros_like(t)
    off = t % page_block_size
    # a slot int32 cannot hold is no slot (it must not wrap into a valid one); tested before the
    # product, which an int64 table entry near 2^63 would overflow
    ok = ok & (phys >= 0) & (phys <= torch.div(_INT32_MAX - off, page_block_size, rounding_mode="floor"))
    res = torch.where(ok, phys, torch.zeros_like(phys)) * page_block_size + off
    return torch.where(ok, res, torch.full_like(res, -1)).to(torch.int32)
