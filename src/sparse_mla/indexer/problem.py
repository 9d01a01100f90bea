"""Argument checks of the indexer operations (pure PyTorch; no Triton): errors name the argument."""

from __future__ import annotations

from typing import Any

import torch

from ..core.checks import check_tensor

__all__ = ["HEAD_DIMS", "check_index_cache", "check_tensor_arg", "index_cache_geometry", "type_name"]

#: head dims the indexer kernels take (powers of two; DeepSeek-V3.2 uses 128)
HEAD_DIMS = (16, 32, 64, 128, 256)


#: the largest int32 (positions, lengths and counts the kernels hold in int32)
INT32_MAX = 2**31 - 1


def type_name(x: Any) -> str:
    """``x``'s type for an error message, with its module where that is not the builtins (NumPy 2's
    ``np.bool_`` calls itself ``bool``)."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_tensor_arg(x: Any, name: str, dtypes: tuple, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """:func:`sparse_mla.decode.problem.check_tensor` for the indexer's calls (the device is the first
    tensor's; that one, ``device`` None, must be a CPU or CUDA tensor)."""
    check_tensor(x, name, dtypes, dim, device, device_of="the first tensor argument")
    if device is None and x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got one on {x.device}")
    return x


def check_index_cache(
    kv_cache: Any, head_dim: int | None = None, name: str = "kv_cache", head_dim_from: str = "q"
) -> int:
    """Check an indexer key cache ``[num_blocks, block_size, 1, head_dim + 4]`` uint8 (block-major:
    a block's ``block_size * head_dim`` e4m3 bytes, then its ``block_size`` fp32 scales); returns
    ``head_dim``. The block stride may exceed ``block_size * (head_dim + 4)`` (a pool view) but must
    keep the scales 4-byte aligned; tokens inside a block are packed. Slice a cache by blocks, never
    by tokens inside a block: the scales follow the block's full page of token rows, so a block
    stride that is a whole number of token rows, more than ``block_size`` of them, is refused (what
    a token slice ``kv_cache[:, :n]`` has; a pool that interleaves layers by block cannot be told
    from one and is refused too). Padding of less than a token row, or of bytes that are not a
    whole number of rows, is a pool and accepted."""
    check_tensor_arg(kv_cache, name, (torch.uint8,), 4)
    nb, bs, h_kv, last = kv_cache.shape
    d = last - 4
    if h_kv != 1:
        raise ValueError(
            f"{name}: expected shape [num_blocks, block_size, 1, head_dim + 4], got {list(kv_cache.shape)}"
        )
    if d not in HEAD_DIMS or (head_dim is not None and d != head_dim):
        want = (
            f"{head_dim} + 4 ({head_dim_from}'s head_dim)"
            if head_dim is not None
            else f"head_dim + 4 with head_dim in {HEAD_DIMS}"
        )
        raise ValueError(f"{name}: last dim must be {want}, got {last}")
    if bs < 1 or nb < 1:
        raise ValueError(f"{name}: needs at least one block of at least one token, got {list(kv_cache.shape)}")
    if kv_cache.stride(3) != 1 or (bs > 1 and kv_cache.stride(1) != last):
        raise ValueError(
            f"{name}: tokens must be packed inside a block (strides [*, {last}, *, 1]), got {list(kv_cache.stride())}"
        )
    stride = kv_cache.stride(0)
    if stride % last == 0 and stride // last > bs:
        raise ValueError(
            f"{name}: blocks of {bs} tokens start every {stride // last} token rows ({stride} bytes): a view that "
            "slices the tokens inside a block (kv_cache[:, :n]) has its scales elsewhere (they follow the full "
            "page of rows), and a pool interleaving layers by block cannot be told from one; slice whole blocks "
            "(kv_cache[i:j]) of a per-layer cache instead"
        )
    if nb > 1 and kv_cache.stride(0) < bs * last:
        raise ValueError(f"{name}: block stride {kv_cache.stride(0)} < the {bs * last} bytes of one block")
    if (nb > 1 and kv_cache.stride(0) % 4) or kv_cache.data_ptr() % 4:
        raise ValueError(
            f"{name}: blocks must start 4-byte aligned (the fp32 scales), got start offset "
            f"{kv_cache.data_ptr() % 4} mod 4 and block stride {kv_cache.stride(0)}"
        )
    # (the last block's bytes are the view's own last bytes: check_tensor_arg checked that they
    # lie inside the storage)
    return d


def index_cache_geometry(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, head_dim, block_stride)`` of a checked indexer cache."""
    nb, bs, _, last = kv_cache.shape
    return int(nb), int(bs), int(last) - 4, int(kv_cache.stride(0)) if nb > 1 else int(bs * last)
