"""The fused quantise-and-store kernel: new tokens' latent KV into the paged FP8 cache.

Every decode (or prefill) step an inference engine appends the new tokens' latent vectors
``kv [n, d_qk]`` (bf16) to the paged cache at ``slot_mapping [n]`` (``block * page_block_size +
offset``; ``-1`` = skip, e.g. padding tokens). This kernel quantises and writes them in place,
byte-identical to :func:`sparse_mla.quantize_k_cache` on the same values
(PyTorch twin: :func:`sparse_mla.kvcache.reference.quantize_and_store_kv_reference`).

One program handles ``BLOCK_T`` tokens. Per token and tile of ``TILE`` NoPE values (V32: 4 x 128,
MODEL1: 7 x 64):

* the UE8M0 scale ``2^k``, ``k = ceil(log2(max(amax / 448, 1e-4)))``, is computed exactly from the
  float32 bits of ``amax``: with ``amax = 1.m * 2^e``, ``amax / 448 = (1.m / 1.75) * 2^(e - 8)``, so
  ``k = e - 8 + (1.m > 1.75)`` (mantissa field > ``0x600000``), then ``k = max(k, -13)`` because
  ``ceil(log2(1e-4)) = -13`` and ``ceil∘log2`` is monotone. No logarithm, no division (Triton's
  default fp32 division is not correctly rounded on the GPU, which would move ``amax = 448·2^j``
  across a power of two). The rounding of ``amax / 448`` in the reference never lands on a
  power of two unless the quotient is one (an fp32 ``amax`` next to ``448·2^j`` is ``2^-23.8``
  away in relative terms, more than half an ulp), so the two agree on every input.
* values are multiplied by ``2^-k`` (exact), clamped to ±448 and rounded to e4m3 with
  round-to-nearest-even by integer operations on the float32 bits (normal range: drop 20 mantissa
  bits with the usual ``+0x7FFFF + lsb`` trick and rebias the exponent; subnormal range
  ``|y| < 2^-6``: shift the 24-bit significand with an explicit round-half-even). This gives the
  same bytes on every GPU (no dependence on a hardware e4m3 converter, which pre-Hopper GPUs lack)
  and in the Triton interpreter. The sign is kept (``-0`` and tiny negatives give ``0x80`` as in
  PyTorch).
* the 64 RoPE values are copied bit for bit (as int16), never converted.

Slots outside ``[0, num_blocks * page_block_size)`` are never written (masked stores); the
launcher additionally rejects them before launch when ``slot_mapping`` lives on the CPU, where
that costs no device synchronisation. Two tokens with the same slot race (one of them wins), as
in other engines' cache writers: give distinct slots.

Non-finite inputs (inf/NaN in ``kv``) are not supported: the bytes written for such a tile are
unspecified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.env import cdiv, next_pow2, require_runnable
from ...core.fp8 import ceil_log2_div448, e4m3_rtne_bits
from ...core.paging import slot_records
from ...formats import KVCacheLayout, cache_bytes

__all__ = ["launch"]


@triton.jit
def _quantize_store_kernel(
    kv_ptr,
    stride_kv,
    slot_ptr,
    stride_slot,
    cache_ptr,
    stride_blk,
    stride_tok,
    pbs,
    num_slots,
    n,
    IS_V32: tl.constexpr,
    D_NOPE: tl.constexpr,
    D_ROPE: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    TILE: tl.constexpr,
    NUM_TILES: tl.constexpr,
    TILES_P2: tl.constexpr,
    SCALE_REC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    toks, valid, off, base = slot_records(slot_ptr, stride_slot, n, num_slots, pbs, stride_blk, BLOCK_T)
    if IS_V32:
        tok = base + off * stride_tok
    else:
        tok = base + off * DATA_BYTES

    tiles = tl.arange(0, TILES_P2)
    cols = tl.arange(0, TILE)
    tmask = tiles < NUM_TILES
    d = tiles[:, None] * TILE + cols[None, :]  # [TILES_P2, TILE] NoPE dim of each element
    row = kv_ptr + toks.to(tl.int64) * stride_kv  # [BLOCK_T]
    m3 = valid[:, None, None] & tmask[None, :, None]
    x = tl.load(row[:, None, None] + d[None, :, :], mask=m3, other=0.0).to(tl.float32)

    # exact UE8M0 exponent k = ceil(log2(max(amax / 448, 1e-4))), amax over the finite values (a NaN
    # or +-inf value is stored as the NaN byte 0x7F, as the twin does)
    finite = tl.abs(x) < float("inf")  # False for NaN too
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=2)  # [BLOCK_T, TILES_P2]
    k = tl.maximum(ceil_log2_div448(amax), -13)
    inv_scale = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2^-k, exact
    y = x * inv_scale[:, :, None]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    q8 = tl.where(finite, e4m3_rtne_bits(y), 0x7F).to(tl.uint8)
    tl.store(cache_ptr + tok[:, None, None] + d[None, :, :], q8, mask=m3)

    if IS_V32:
        scale = ((k + 127) << 23).to(tl.float32, bitcast=True)  # 2^k
        sptr = (cache_ptr + tok + D_NOPE).to(tl.pointer_type(tl.float32))
        tl.store(sptr[:, None] + tiles[None, :], scale, mask=valid[:, None] & tmask[None, :])
        rope_dst = (cache_ptr + tok + D_NOPE + 4 * NUM_TILES).to(tl.pointer_type(tl.int16))
    else:
        # e8m0 exponent bytes (k + 127) and a zero pad byte, after all tokens' [nope | rope] records
        e8 = tl.where(tmask[None, :], k + 127, 0).to(tl.uint8)
        eptr = cache_ptr + base + pbs * DATA_BYTES + off * SCALE_REC
        tl.store(eptr[:, None] + tiles[None, :], e8, mask=valid[:, None])
        rope_dst = (cache_ptr + tok + D_NOPE).to(tl.pointer_type(tl.int16))
    rc = tl.arange(0, D_ROPE)
    rope_src = (row + D_NOPE).to(tl.pointer_type(tl.int16))
    rope = tl.load(rope_src[:, None] + rc[None, :], mask=valid[:, None], other=0)
    tl.store(rope_dst[:, None] + rc[None, :], rope, mask=valid[:, None])


def launch(
    kv: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor, lay: KVCacheLayout, block_t: int
) -> None:
    """Launch the kernel on validated arguments (no slot-range check: the kernel masks bad slots)."""
    require_runnable(_quantize_store_kernel, k_cache.device)
    raw = cache_bytes(k_cache)
    nb, pbs = raw.shape[0], raw.shape[1]
    n = kv.shape[0]
    grid = (cdiv(n, block_t),)
    _quantize_store_kernel[grid](
        kv,
        kv.stride(0),
        slot_mapping,
        slot_mapping.stride(0),
        raw,
        raw.stride(0),
        raw.stride(1),
        pbs,
        nb * pbs,
        n,
        IS_V32=lay.name == "V32",
        D_NOPE=lay.d_nope,
        D_ROPE=lay.d_rope,
        DATA_BYTES=lay.data_bytes,
        TILE=lay.tile,
        NUM_TILES=lay.num_tiles,
        TILES_P2=next_pow2(lay.num_tiles),
        SCALE_REC=lay.scale_section_bytes,
        BLOCK_T=block_t,
        num_warps=4,
    )
