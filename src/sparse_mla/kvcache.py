"""FP8 paged KV-cache layouts of DeepSeek Sparse Attention (seed step 4, DESIGN §4).

Two layouts, both "latent" MLA caches with a single KV head (``h_kv = 1``):

* **V32** (``d_qk = 576``, DeepSeek-V3.2): every token owns 656 contiguous bytes::

      bytes   0..511  512 x float8_e4m3 NoPE values (4 tiles of 128)
      bytes 512..527  4 x float32 dequantisation scales, one per tile (powers of two)
      bytes 528..655  64 x bfloat16 RoPE values (not quantised)

* **MODEL1** (``d_qk = 512``): 448 NoPE values in 7 tiles of 64, 64 bf16 RoPE values and
  7 float8_e8m0 scales (+1 pad byte), 584 bytes per token. Inside one page block all tokens'
  ``[nope | rope]`` records (576 B each) come first, then all tokens' 8 scale bytes.
  :func:`quantize_k_cache` pads each block to a multiple of 576 bytes as FlashMLA does, so the
  cache tensor is a strided view ``[num_blocks, page_block_size, 1, 584]`` whose block stride is
  the padded block size; the kernels accept any block stride of at least
  ``page_block_size * 584`` bytes (a dense copy of the view, too).

Scales are UE8M0 (powers of two): ``scale = 2^ceil(log2(max(amax / 448, 1e-4)))`` and the stored
value is ``x / scale`` rounded to e4m3, so dequantisation (``fp8 * scale``) is exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

__all__ = [
    "KVCacheLayout",
    "V32",
    "MODEL1",
    "get_layout",
    "quantize_k_cache",
    "dequantize_k_cache",
    "abs_indices_to_kvcache_indices",
    "ue8m0_scale",
]

FP8_E4M3_MAX = 448.0
_INT32_MAX = 2**31 - 1
SCALE_AMAX_FLOOR = 1e-4


@dataclass(frozen=True)
class KVCacheLayout:
    """Constants of one FP8 cache layout, all derived from ``d_qk``.

    Attributes:
        name: ``"V32"`` or ``"MODEL1"``.
        d_qk: head dimension of q and k (576 or 512).
        d_v: head dimension of v (always 512; v is the first ``d_v`` dims of k).
        d_rope: RoPE dims kept in bf16 (64).
        d_nope: FP8-quantised dims, ``d_qk - d_rope``.
        tile: values per scale (128 for V32, 64 for MODEL1).
        scale_bytes: bytes of one scale (4 = float32 for V32, 1 = e8m0 for MODEL1).
        bytes_per_token: last dimension of the cache tensor (656 or 584).
    """

    name: str
    d_qk: int
    d_v: int
    d_rope: int
    tile: int
    scale_bytes: int

    @property
    def d_nope(self) -> int:
        return self.d_qk - self.d_rope

    @property
    def num_tiles(self) -> int:
        return self.d_nope // self.tile

    @property
    def scale_section_bytes(self) -> int:
        """Bytes of a token's scale record (V32: 16; MODEL1: 7 scales + 1 pad = 8)."""
        n = self.num_tiles * self.scale_bytes
        return n if self.name == "V32" else n + 1

    @property
    def data_bytes(self) -> int:
        """Bytes of a token's ``[nope fp8 | rope bf16]`` part (576 for both layouts)."""
        return self.d_nope + 2 * self.d_rope

    @property
    def bytes_per_token(self) -> int:
        return self.d_nope + self.scale_section_bytes + 2 * self.d_rope

    # byte offsets inside a V32 token record
    @property
    def scale_offset(self) -> int:
        """V32: offset of the scales in a token record; MODEL1: offset of a block's scale section
        per token is computed by :meth:`block_bytes` users (``page_block_size * 576``)."""
        return self.d_nope

    @property
    def rope_offset(self) -> int:
        return self.d_nope + self.scale_section_bytes if self.name == "V32" else self.d_nope

    def block_bytes(self, page_block_size: int) -> int:
        """Smallest legal byte stride between page blocks."""
        raw = page_block_size * self.bytes_per_token
        if self.name == "V32":
            return raw
        return -(-raw // self.data_bytes) * self.data_bytes


V32 = KVCacheLayout(name="V32", d_qk=576, d_v=512, d_rope=64, tile=128, scale_bytes=4)
MODEL1 = KVCacheLayout(name="MODEL1", d_qk=512, d_v=512, d_rope=64, tile=64, scale_bytes=1)
_LAYOUTS = {"V32": V32, "MODEL1": MODEL1}

LayoutLike = Union[str, KVCacheLayout, int]


def get_layout(layout: LayoutLike) -> KVCacheLayout:
    """Resolve ``"V32"``/``"MODEL1"``, a :class:`KVCacheLayout`, or a ``d_qk`` (576/512).

    Raises:
        ValueError: unknown name or ``d_qk``.
        TypeError: anything else.
    """
    if isinstance(layout, KVCacheLayout):
        return layout
    if isinstance(layout, bool):
        raise TypeError(f"layout: expected 'V32', 'MODEL1', a KVCacheLayout or d_qk, got {layout!r}")
    if isinstance(layout, int):
        for lay in _LAYOUTS.values():
            if lay.d_qk == layout:
                return lay
        raise ValueError(f"layout: d_qk must be 576 (V32) or 512 (MODEL1), got {layout}")
    if isinstance(layout, str):
        key = layout.upper()
        if key in ("V3.2", "V3_2"):
            key = "V32"
        if key not in _LAYOUTS:
            raise ValueError(f"layout: expected 'V32' or 'MODEL1', got {layout!r}")
        return _LAYOUTS[key]
    raise TypeError(f"layout: expected 'V32', 'MODEL1', a KVCacheLayout or d_qk, got {type(layout).__name__}")


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale ``2^ceil(log2(max(amax/448, 1e-4)))`` computed exactly (float32).

    ``frexp`` gives ``v = m * 2^e`` with ``m`` in [0.5, 1): ``ceil(log2 v)`` is ``e - 1`` when
    ``m == 0.5`` (v is a power of two) and ``e`` otherwise, with no rounding of a logarithm.
    """
    v = torch.clamp(amax.float() / FP8_E4M3_MAX, min=SCALE_AMAX_FLOOR)
    m, e = torch.frexp(v)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(v), e)


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
    scale = ue8m0_scale(tiles.abs().amax(dim=-1))
    q = torch.clamp(tiles / scale.unsqueeze(-1), -FP8_E4M3_MAX, FP8_E4M3_MAX)
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


def cache_bytes(k_cache: torch.Tensor) -> torch.Tensor:
    """The cache as raw bytes (uint8 view with the same shape and strides)."""
    return k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)


def gather_dequant_tokens(
    k_cache: torch.Tensor, layout: LayoutLike, token_idx: torch.Tensor
) -> torch.Tensor:
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


def _check_quantized_cache(kq: torch.Tensor, lay: KVCacheLayout, name: str = "k_cache") -> None:
    """Dtype, shape and stride checks of an FP8 cache tensor (raise ``TypeError``/``ValueError`` naming it).

    A MODEL1 block needs ``page_block_size * 584`` bytes; the block stride may be anything at
    least that (FlashMLA pads blocks to a multiple of 576 B because its kernels need it; ours follow
    ``stride(0)``, so a dense copy of a padded view, as ``Tensor.to``, ``.clone()`` or
    functionalization make, is accepted too).
    """
    if not isinstance(kq, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(kq).__name__}")
    if kq.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"{name}: expected dtype torch.float8_e4m3fn or torch.uint8 (raw bytes), got {kq.dtype}")
    if kq.dim() != 4 or kq.shape[2] != 1 or kq.shape[3] != lay.bytes_per_token:
        raise ValueError(
            f"{name}: expected shape [num_blocks, page_block_size, 1, {lay.bytes_per_token}] "
            f"({lay.name} layout, d_qk={lay.d_qk}), got {list(kq.shape)}"
        )
    pbs = kq.shape[1]
    if kq.stride(3) != 1:
        raise ValueError(f"{name}: the byte dimension must be contiguous (stride(3) == 1), got {kq.stride(3)}")
    if lay.name == "V32":
        if kq.stride(1) < lay.bytes_per_token and pbs > 1:
            raise ValueError(f"{name}: token stride {kq.stride(1)} < {lay.bytes_per_token} bytes")
        need = (pbs - 1) * kq.stride(1) + lay.bytes_per_token
    else:
        if kq.stride(1) != lay.bytes_per_token and pbs > 1:
            raise ValueError(
                f"{name}: MODEL1 blocks must be packed (token stride {lay.bytes_per_token}), got {kq.stride(1)}"
            )
        need = pbs * lay.bytes_per_token
    if kq.shape[0] > 1 and kq.stride(0) < need:
        raise ValueError(f"{name}: block stride {kq.stride(0)} bytes < the {need} bytes one {lay.name} block needs")
    # the bytes the last block's tokens use must lie inside the storage (for MODEL1 they end with
    # the last token's scale record: padding after it is never accessed)
    if kq.shape[0] > 0:
        end = kq.storage_offset() + (kq.shape[0] - 1) * kq.stride(0) + need
        if end > kq.untyped_storage().nbytes():
            raise ValueError(
                f"{name}: the {lay.name} layout needs {need} bytes per block but the storage ends "
                f"{end - kq.untyped_storage().nbytes()} bytes early"
            )


def dequantize_k_cache(kq: torch.Tensor, layout: LayoutLike = "V32", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_k_cache`: ``[num_blocks, page_block_size, 1, d_qk]`` of ``dtype``.

    Dequantisation is exact (power-of-two scales), so bf16 output loses nothing.

    Raises:
        TypeError / ValueError: cache of the wrong dtype, shape or strides for the layout.
    """
    lay = get_layout(layout)
    _check_quantized_cache(kq, lay, "kq")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"dtype: expected a floating torch.dtype of 16 or more bits (e.g. torch.bfloat16), got {dtype!r}")
    nb, pbs = kq.shape[0], kq.shape[1]
    idx = torch.arange(nb * pbs, device=kq.device)
    return gather_dequant_tokens(kq, lay, idx).to(dtype).view(nb, pbs, 1, lay.d_qk)


def _check_abs_index_args(abs_indices: torch.Tensor, block_table: torch.Tensor, page_block_size: int) -> None:
    """Argument checks shared by :func:`abs_indices_to_kvcache_indices` and its Triton twin."""
    if not isinstance(abs_indices, torch.Tensor) or abs_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError("abs_indices: expected an int32 tensor [b, s_q, topk]")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError("block_table: expected an int32 tensor [b, max_blocks_per_seq]")
    if isinstance(page_block_size, bool) or not isinstance(page_block_size, int) or page_block_size <= 0:
        raise ValueError(f"page_block_size: expected a positive int, got {page_block_size!r}")
    if abs_indices.dim() != 3:
        raise ValueError(f"abs_indices: expected shape [b, s_q, topk], got {list(abs_indices.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != abs_indices.shape[0]:
        raise ValueError(
            f"block_table: expected shape [b={abs_indices.shape[0]}, max_blocks_per_seq], got {list(block_table.shape)}"
        )
    if block_table.device != abs_indices.device:
        raise ValueError("block_table: must be on the same device as abs_indices")


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
        t % page_block_size``; ``-1`` where the position is ``-1``, outside the block table, or
        maps to a negative block or to a slot past int32.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or ``page_block_size``.
    """
    _check_abs_index_args(abs_indices, block_table, page_block_size)
    t = abs_indices.long()
    lb = torch.div(t, page_block_size, rounding_mode="floor")
    nlog = block_table.shape[1]
    ok = (t >= 0) & (lb < nlog)
    lb_safe = torch.where(ok, lb, torch.zeros_like(lb)).reshape(t.shape[0], t.shape[1] * t.shape[2])
    phys = torch.gather(block_table.long(), 1, lb_safe).view_as(t) if nlog > 0 else torch.zeros_like(t)
    ok = ok & (phys >= 0)
    res = phys * page_block_size + t % page_block_size
    ok = ok & (res <= _INT32_MAX)  # a slot int32 cannot hold is no slot (it must not wrap into a valid one)
    return torch.where(ok, res, torch.full_like(res, -1)).to(torch.int32)


def num_cache_tokens(k_cache: torch.Tensor) -> int:
    """Number of addressable token slots (``num_blocks * page_block_size``)."""
    return int(k_cache.shape[0]) * int(k_cache.shape[1])


