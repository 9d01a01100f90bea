"""Fused quantise-and-store of new tokens' latent KV into the paged FP8 cache: the call an engine
makes every step (validation and ``backend=`` here; the kernel, and how it rounds, in
:mod:`.kernels.store`; the twin in :mod:`.reference`). Importing this module imports no Triton."""

from __future__ import annotations

from typing import Any

import torch

from ..core.env import on_tensor_device
from ..core.traced import deferred_output
from ..formats import LayoutLike, get_layout, layout_of_cache
from .backends import KVCACHE_BACKENDS
from .problem import check_store_args

__all__ = ["quantize_and_store_kv"]


@on_tensor_device
def quantize_and_store_kv(
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    layout: LayoutLike | None = None,
    *,
    block_t: int | None = None,
    backend: str = "auto",
) -> None:
    """Quantise new tokens' latent KV and write them in place into a paged FP8 cache.

    The bytes written for a token are exactly those :func:`sparse_mla.quantize_k_cache`
    gives for the same bf16 values; bytes of other slots (and MODEL1 block padding) are untouched.
    Runs the Triton kernel on CUDA and under ``TRITON_INTERPRET=1``, else the PyTorch twin
    :func:`sparse_mla.kvcache.reference.quantize_and_store_kv_reference`. No host synchronisation on CUDA
    (CUDA-graph safe).

    Args:
        kv: ``[n, d_qk]`` bfloat16 latent ``[nope | rope]`` vectors of the new tokens; ``d_qk`` is
            576 for a V32 cache and 512 for a MODEL1 cache; last dim contiguous, row stride free.
        slot_mapping: ``[n]`` int64 (int32 accepted), destination slot of each token,
            ``block * page_block_size + offset``; ``-1`` skips the token. Slots outside
            ``[0, num_blocks * page_block_size)`` raise ``ValueError`` when ``slot_mapping`` is on
            the CPU; on the GPU (where checking would need a sync) they are silently skipped.
            Slots should be distinct (duplicates race).
        k_cache: ``[num_blocks, page_block_size, 1, bytes_per_token]`` ``float8_e4m3fn`` or
            ``uint8``, 656 B/token (V32) or 584 (MODEL1, any block stride >= page_block_size * 584); may be
            a strided view of a larger pool (its strides are honoured). Written in place.
        layout: optional ``"V32"``/``"MODEL1"``; when given it must agree with ``k_cache``.
        block_t: tokens per Triton program (a power of two <= 64; default: 1 for small ``n``, else 4).
        backend: ``"auto"``, ``"portable"`` (the Triton kernel) or ``"reference"`` (the twin), resolved
            as every operation's (:mod:`sparse_mla.core.backend`).

    Raises:
        TypeError: wrong dtypes (``kv`` not bf16, ``slot_mapping`` not int64/int32, cache not
            fp8/uint8) or non-tensors.
        ValueError: shapes, ``d_qk`` not matching the cache layout, devices differ, misaligned
            cache, out-of-range slots (CPU ``slot_mapping`` only), bad ``block_t``, a ``backend``
            that is unknown or cannot serve the tensors' device.
    """
    if torch.compiler.is_compiling():  # one operator in the graph (its tensors checked when it runs)
        try:  # the scalars are fixed while tracing: a failed check raises when the graph runs
            _check_block_t(block_t)
            if (
                layout is not None
                and isinstance(k_cache, torch.Tensor)
                and get_layout(layout) != layout_of_cache(k_cache)
            ):
                raise ValueError(
                    f"layout: {get_layout(layout).name} given, but k_cache has {k_cache.shape[-1]} bytes per token"
                )
            if not isinstance(backend, str) or backend != "auto":
                KVCACHE_BACKENDS.get(backend)  # an unknown name raises
        except (TypeError, ValueError) as e:
            deferred_output(e, kv, (0,))
            return
        torch.ops.sparse_mla.quantize_and_store_kv(kv, slot_mapping, k_cache)
        return
    lay = check_store_args(kv, slot_mapping, k_cache, layout)
    n = kv.shape[0]
    _check_block_t(block_t)
    if block_t is None:
        block_t = 1 if n < 1024 else 4
    kernels = KVCACHE_BACKENDS.runs_kernels(k_cache.device, backend)
    if n == 0 or k_cache.numel() == 0:
        return
    if not kernels:
        from .reference import quantize_and_store_kv_reference

        quantize_and_store_kv_reference(kv, slot_mapping, k_cache)
        return
    from .kernels.store import launch

    launch(kv, slot_mapping, k_cache, lay, block_t)


def _check_block_t(block_t: Any) -> None:
    if block_t is None:
        return
    if isinstance(block_t, bool) or not isinstance(block_t, int) or not 1 <= block_t <= 64 or block_t & (block_t - 1):
        raise ValueError(f"block_t: expected a power of two in [1, 64], got {block_t!r}")
