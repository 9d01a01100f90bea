"""FP8 paged KV-cache layouts of DeepSeek Sparse Attention (step 4 in docs/design.md).

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
  the padded block size; the kernels accept it or the packed ``page_block_size * 584`` bytes (a
  dense copy), nothing else: another stride is what a view slicing the tokens inside a block has
  (:func:`check_quantized_cache`).

Scales are UE8M0 (powers of two): ``scale = 2^ceil(log2(max(amax / 448, 1e-4)))`` and the stored
value is ``x / scale`` rounded to e4m3, so dequantisation (``fp8 * scale``) is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import check_plain_storage

__all__ = [
    "check_cache",
    "KVCacheLayout",
    "V32",
    "MODEL1",
    "LayoutLike",
    "get_layout",
    "layout_of_cache",
    "cache_bytes",
    "check_quantized_cache",
    "check_cache_alignment",
    "num_cache_tokens",
]

FP8_E4M3_MAX = 448.0
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
        """Byte stride between page blocks of the caches :func:`quantize_k_cache` makes (FlashMLA's:
        V32 packed, MODEL1 padded to a multiple of 576 bytes)."""
        raw = page_block_size * self.bytes_per_token
        if self.name == "V32":
            return raw
        return -(-raw // self.data_bytes) * self.data_bytes


V32 = KVCacheLayout(name="V32", d_qk=576, d_v=512, d_rope=64, tile=128, scale_bytes=4)
MODEL1 = KVCacheLayout(name="MODEL1", d_qk=512, d_v=512, d_rope=64, tile=64, scale_bytes=1)
_LAYOUTS = {"V32": V32, "MODEL1": MODEL1}

LayoutLike = str | KVCacheLayout | int


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


def layout_of_cache(k_cache: torch.Tensor) -> KVCacheLayout:
    """The layout told by a cache's last dimension: 656 bytes/token -> V32, 584 -> MODEL1.

    Raises:
        TypeError: ``k_cache`` is not a tensor.
        ValueError: its shape is not ``[num_blocks, page_block_size, 1, 656 | 584]``.
    """
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache: expected a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache: expected shape [num_blocks, page_block_size, 1, bytes_per_token], got {list(k_cache.shape)}"
        )
    bpt = int(k_cache.shape[-1])
    for lay in _LAYOUTS.values():
        if lay.bytes_per_token == bpt:
            return lay
    raise ValueError(f"k_cache: bytes_per_token (last dim) must be 656 (V32) or 584 (MODEL1), got {bpt}")


def cache_bytes(k_cache: torch.Tensor) -> torch.Tensor:
    """The cache as raw bytes (uint8 view with the same shape and strides)."""
    return k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)


def check_quantized_cache(kq: torch.Tensor, lay: KVCacheLayout, name: str = "k_cache") -> None:
    """Dtype, shape and stride checks of an FP8 cache tensor (raise ``TypeError``/``ValueError`` naming it).

    A MODEL1 block is ``page_block_size`` 576-byte records followed by their 8-byte scale rows, so
    its block stride must be exactly one of the two pool layouts: packed, ``page_block_size * 584``
    bytes (what ``Tensor.to``, ``.clone()`` or functionalization make of a padded cache), or that
    padded to a multiple of 576 bytes (FlashMLA's, :meth:`KVCacheLayout.block_bytes`). Any other
    stride is a ``ValueError``: it is what a view that slices the tokens inside a block has
    (``k_cache[:, :n]``, of either layout, whatever its dtype), whose scale rows are not where its
    shape says and whose every read would be wrong. Slice whole blocks (``k_cache[i:j]``) instead.
    A pool that interleaves several layers' blocks has a larger stride and is refused too: strides
    cannot tell it from a token slice. A V32 record holds its own scales: any block stride of at
    least one block's bytes is accepted.
    """
    if not isinstance(kq, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(kq).__name__}")
    if kq.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"{name}: expected dtype torch.float8_e4m3fn or torch.uint8 (raw bytes), got {kq.dtype}")
    check_plain_storage(kq, name)
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
        _check_model1_blocks(kq, pbs, need, lay.block_bytes(pbs), name)
    if kq.shape[0] > 1 and kq.stride(0) < need:
        raise ValueError(f"{name}: block stride {kq.stride(0)} bytes < the {need} bytes one {lay.name} block needs")
    # (the bytes the last block's tokens use, ``need`` from its start, are the view's own last
    # bytes: check_plain_storage above checked that they lie inside the storage)


def _check_model1_blocks(kq: torch.Tensor, pbs: int, packed: int, padded: int, name: str) -> None:
    """A MODEL1 cache's blocks are whole (:func:`check_quantized_cache`), else ``ValueError``."""
    stride = kq.stride(0)  # (one block too: k_cache[:1, :n] keeps the stride of its pool)
    if stride not in (packed, padded):
        raise ValueError(
            f"{name}: a MODEL1 block of {pbs} tokens starts every {stride} bytes, neither page_block_size x 584 = "
            f"{packed} (packed) nor {padded} (padded to a multiple of 576, FlashMLA's): a view that slices the "
            "tokens inside a block (k_cache[:, :n]) has its scale rows elsewhere, and a pool interleaving layers "
            "by block cannot be told from one; slice whole blocks (k_cache[i:j]) of a per-layer cache instead"
        )


def check_cache_alignment(kq: torch.Tensor, lay: KVCacheLayout, name: str = "k_cache") -> None:
    """The kernels read a V32 record's float32 scales and bf16 RoPE values (MODEL1: bf16 RoPE) through
    typed pointers: its start and block/token strides must be 4-byte (MODEL1: 2-byte) aligned, else
    ``ValueError`` naming ``name`` (a misaligned view would fault on a GPU)."""
    align = 4 if lay.name == "V32" else 2
    raw = cache_bytes(kq)
    if kq.numel() and (raw.data_ptr() % align or raw.stride(0) % align or (raw.shape[1] > 1 and raw.stride(1) % align)):
        raise ValueError(
            f"{name}: the {lay.name} layout needs its start and block/token strides aligned to {align} bytes, "
            f"got offset {raw.data_ptr() % 16} mod 16 and strides {list(raw.stride())}"
        )


def num_cache_tokens(k_cache: torch.Tensor) -> int:
    """Number of addressable token slots (``num_blocks * page_block_size``)."""
    return int(k_cache.shape[0]) * int(k_cache.shape[1])


def check_cache(kc: Any, name: str, lay: KVCacheLayout, dev: torch.device) -> None:
    """``kc`` is an FP8 paged cache of layout ``lay`` on ``dev`` (the device of ``q``): ``[num_blocks >= 1,
    page_block_size >= 1, 1, bytes_per_token]`` with a block stride the kernels can address
    (:func:`check_quantized_cache`, :func:`check_cache_alignment`), else ``TypeError``/``ValueError``
    naming ``name``."""
    if not isinstance(kc, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(kc).__name__}")
    if kc.device != dev:
        raise ValueError(f"{name}: expected a tensor on {dev} (where q is), got {kc.device}")
    if kc.dim() == 4 and kc.shape[2] != 1:
        raise ValueError(f"{name}: h_kv (dim 2) must be 1 for MLA, got {kc.shape[2]}")
    check_quantized_cache(kc, lay, name)
    check_cache_alignment(kc, lay, name)
    if kc.shape[0] < 1 or kc.shape[1] < 1:
        raise ValueError(f"{name}: needs at least one block of at least one token, got {list(kc.shape)}")
