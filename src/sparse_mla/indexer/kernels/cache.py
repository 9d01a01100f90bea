"""The indexer key cache's fused quantise-and-store: each key scaled to e4m3 (a per-key fp32 scale,
or a power of two with ``ue8m0``) and written with its scale into its cache slot. Twin:
:func:`sparse_mla.indexer.reference.indexer_k_quant_and_cache_reference`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.env import cdiv, require_runnable
from ...core.fp8 import ceil_log2_div448, e4m3_rtne_bits
from ...core.paging import slot_records
from ..problem import index_cache_geometry

__all__ = ["launch_quant_store"]


@triton.jit
def _index_quant_store_kernel(
    k_ptr,
    stride_k,
    slot_ptr,
    stride_slot,
    cache_ptr,
    stride_blk,
    bs,
    num_slots,
    n,
    D: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    toks, valid, off, base = slot_records(slot_ptr, stride_slot, n, num_slots, bs, stride_blk, BLOCK_T)
    cols = tl.arange(0, D)
    x = tl.load(k_ptr + toks.to(tl.int64)[:, None] * stride_k + cols[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    if UE8M0:
        e = ceil_log2_div448(amax)  # scale 2^e
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        y = x * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # x / 2^e, exact
    else:
        scale = tl.math.div_rn(amax, 448.0)
        y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    q8 = e4m3_rtne_bits(y)
    # a key with a NaN or inf value is stored as NaN (bytes 0x7F, scale NaN), as the twin does
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1) > 0
    q8 = tl.where(bad[:, None], 0x7F, q8).to(tl.uint8)
    scale = tl.where(bad, float("nan"), scale)
    tl.store(cache_ptr + base[:, None] + off[:, None] * D + cols[None, :], q8, mask=valid[:, None])
    sptr = (cache_ptr + base + bs * D + off * 4).to(tl.pointer_type(tl.float32))
    tl.store(sptr, scale, mask=valid)


def launch_quant_store(
    k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, d: int, ue8m0: bool
) -> None:
    require_runnable(_index_quant_store_kernel, kv_cache.device, e4m3_rtne_bits, ceil_log2_div448, slot_records)
    nb, bs, _, stride_blk = index_cache_geometry(kv_cache)
    n = k.shape[0]
    block_t = 16
    _index_quant_store_kernel[(cdiv(n, block_t),)](
        k, k.stride(0), slot_mapping, slot_mapping.stride(0), kv_cache, stride_blk, bs, nb * bs, n,
        D=d, UE8M0=ue8m0, BLOCK_T=block_t,
    )  # fmt: skip
