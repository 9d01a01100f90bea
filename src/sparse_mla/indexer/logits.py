"""Indexer logits (DeepSeek-V3.2's lightning indexer; DeepGEMM's ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits`` calls):
``logits[i, j] = k_scale[j] · Σ_h weights[i, h] · relu(q[i, h] · k[j])``, fp32, ``-inf`` where key
``j`` is not visible to query ``i`` (the model's order, DeepSeek-V3.2's formula and DeepGEMM's: the same as
``Σ_h weights[i, h] · relu(q[i, h] · k[j] · k_scale[j])`` for every finite scale ``>= 0``, which is all
that :func:`~sparse_mla.indexer.cache.indexer_k_quant_and_cache` writes). Kernels: :mod:`.kernels` (Triton, imported on first use);
twins: :mod:`.reference`. Both functions always write every entry (``clean_logits`` is accepted
for DeepGEMM's signature: the entries outside the visible range are ``-inf`` either way).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..core.checks import shown
from ..core.env import on_tensor_device
from ..core.traced import deferred_output
from .backends import INDEXER_BACKENDS
from .problem import HEAD_DIMS, INT32_MAX, check_index_cache, check_tensor_arg, type_name
from .reference import fp8_mqa_logits_reference, fp8_paged_mqa_logits_reference

__all__ = ["fp8_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "MAX_HEADS"]

#: indexer heads a call may have
MAX_HEADS = 128
_FP8 = (torch.float8_e4m3fn,)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _check_kv_pair(kv: Any) -> None:
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError("kv: expected a tuple (keys [s_kv, D] float8_e4m3fn, key_scales [s_kv] float32)")


def _check_max_context_len(n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 <= n <= INT32_MAX:
        raise ValueError(f"max_context_len: expected an int in [0, 2^31 - 1] (key positions), got {shown(n)!r}")


def _check_bool(x: Any, name: str) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool (True or False), got {type_name(x)}")


def _check_q(q: Any, dim: int) -> tuple[int, int]:
    check_tensor_arg(q, "q", _FP8, dim)
    h, d = q.shape[-2], q.shape[-1]
    if not 1 <= h <= MAX_HEADS:
        raise ValueError(f"q: the number of heads must be in [1, {MAX_HEADS}], got shape {list(q.shape)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS}, got {d}")
    if q.numel() and q.stride(-1) != 1:
        raise ValueError("q: the last dimension must be contiguous (stride 1)")
    return h, d


def _check_weights(weights: Any, rows: int, h: int, dev: torch.device, rows_name: str) -> None:
    check_tensor_arg(weights, "weights", (torch.float32,), 2, dev)
    if tuple(weights.shape) != (rows, h):
        raise ValueError(f"weights: expected shape [{rows_name}={rows}, H={h}], got {list(weights.shape)}")


def _check_int_vector(x: Any, name: str, n: int, n_name: str, dev: torch.device) -> torch.Tensor:
    check_tensor_arg(x, name, (torch.int32,), 1, dev)
    if x.shape[0] != n:
        raise ValueError(f"{name}: expected shape [{n_name}={n}], got {list(x.shape)}")
    return x.contiguous()


@on_tensor_device
def fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool = True,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Prefill indexer logits over a contiguous FP8 key buffer.

    Args:
        q: ``[s_q, H, D]`` float8_e4m3fn queries (H 1..128; D 16..256, a power of two; last dim
            contiguous).
        kv: ``(keys [s_kv, D] float8_e4m3fn, key_scales [s_kv] fp32)``.
        weights: ``[s_q, H]`` fp32 per-head weights (DeepSeek folds the query scales into them).
        cu_seqlen_ks, cu_seqlen_ke: ``[s_q]`` int32: query ``i`` sees keys ``ks[i] <= j < ke[i]``.
        clean_logits: accepted for DeepGEMM's signature; entries outside ``[ks, ke)`` are ``-inf``.
        backend: ``"auto"``, ``"portable"`` (the Triton kernels) or ``"reference"`` (the PyTorch
            twin), resolved as every operation's (:mod:`sparse_mla.core.backend`).

    Returns:
        ``[s_q, s_kv]`` fp32 logits.

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype, shape, stride or device, or
            a ``backend`` that is unknown or cannot serve the tensors' device.
    """
    if torch.compiler.is_compiling():  # one operator in the graph (its tensors checked when it runs)
        try:  # what is fixed while tracing: a failed check raises when the graph runs
            _check_kv_pair(kv)
            _check_bool(clean_logits, "clean_logits")
            _check_q(q, 3)
        except (TypeError, ValueError) as e:
            return deferred_output(e, q, (0, 0), torch.float32)
        return torch.ops.sparse_mla.fp8_mqa_logits(
            q, kv[0], kv[1], weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, backend
        )
    _check_kv_pair(kv)
    _check_bool(clean_logits, "clean_logits")
    h, d = _check_q(q, 3)
    dev = q.device
    s_q = q.shape[0]
    keys, key_scales = kv
    check_tensor_arg(keys, "kv[0]", _FP8, 2, dev)
    if keys.shape[1] != d:
        raise ValueError(f"kv[0]: expected shape [s_kv, D={d}], got {list(keys.shape)}")
    if keys.numel() and keys.stride(1) != 1:
        raise ValueError("kv[0]: the last dimension must be contiguous (stride 1)")
    s_kv = keys.shape[0]
    check_tensor_arg(key_scales, "kv[1]", (torch.float32,), 1, dev)
    if key_scales.shape[0] != s_kv:
        raise ValueError(f"kv[1]: expected shape [s_kv={s_kv}], got {list(key_scales.shape)}")
    _check_weights(weights, s_q, h, dev, "s_q")
    ks = _check_int_vector(cu_seqlen_ks, "cu_seqlen_ks", s_q, "s_q", dev)
    ke = _check_int_vector(cu_seqlen_ke, "cu_seqlen_ke", s_q, "s_q", dev)
    kernels = INDEXER_BACKENDS.runs_kernels(dev, backend)
    if s_q == 0 or s_kv == 0:
        return torch.full((s_q, s_kv), float("-inf"), dtype=torch.float32, device=dev)
    if not kernels:
        return fp8_mqa_logits_reference(q, keys, key_scales, weights, ks, ke)
    from .kernels import launch_mqa_logits

    out = torch.empty(s_q, s_kv, dtype=torch.float32, device=dev)
    launch_mqa_logits(_as_bytes(q), _as_bytes(keys), key_scales.contiguous(), weights, ks, ke, out)
    return out


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_size: int, num_sms: int) -> torch.Tensor:
    """Schedule metadata for :func:`fp8_paged_mqa_logits` (DeepGEMM's call).

    Our kernel needs no per-request schedule (one program per request, group of query positions
    and even share of the key tiles; the shares are sized so that there are about 16 programs per
    SM): this returns a ``[2]`` int32 CPU tensor ``(block_size, num_sms)``, which
    :func:`fp8_paged_mqa_logits` checks against its cache and uses to size its grid without a
    device synchronisation, so engines written for DeepGEMM keep their two calls. (Moved to a GPU
    it is still accepted; the check is then skipped and the device's own SM count sizes the grid.)

    Raises:
        TypeError / ValueError: ``context_lens`` not a 1-D int32 tensor, or a non-positive size.
    """
    check_tensor_arg(context_lens, "context_lens", (torch.int32,), 1)
    for name, v in (("block_size", block_size), ("num_sms", num_sms)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v < 2**31:
            raise ValueError(f"{name}: expected a positive int below 2^31, got {v!r}")
    return torch.tensor([int(block_size), int(num_sms)], dtype=torch.int32)


@on_tensor_device
def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode indexer logits over the paged FP8 key cache.

    Args:
        q: ``[b, next_n, H, D]`` float8_e4m3fn (last dim contiguous).
        kv_cache: ``[num_blocks, block_size, 1, D + 4]`` uint8 indexer cache (:mod:`.cache`).
        weights: ``[b * next_n, H]`` fp32.
        context_lens: ``[b]`` int32 tokens in each request's context (the new ones included).
        block_table: ``[b, max_blocks]`` int32 cache block of each page of each request; entries
            outside ``[0, num_blocks)`` make their keys ``-inf`` (never read).
        schedule_meta: from :func:`get_paged_mqa_logits_metadata` (its block_size must match).
        max_context_len: columns of the result (int >= 0).
        clean_logits: accepted for DeepGEMM's signature; invisible entries are ``-inf`` either way.
        backend: ``"auto"``, ``"portable"`` (the Triton kernels) or ``"reference"`` (the PyTorch
            twin), resolved as every operation's (:mod:`sparse_mla.core.backend`).

    Returns:
        ``[b * next_n, max_context_len]`` fp32: row ``i * next_n + p`` holds query position ``p`` of
        request ``i``, which sees keys ``j < context_lens[i]`` with ``j <= context_lens[i] - next_n + p``.

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype, shape, stride or device, or
            a ``backend`` that is unknown or cannot serve the tensors' device.
    """
    if torch.compiler.is_compiling():  # one operator in the graph (its tensors checked when it runs)
        try:  # the scalars are fixed while tracing: a failed check raises when the graph runs
            _check_max_context_len(max_context_len)
            _check_bool(clean_logits, "clean_logits")
            _check_q(q, 4)
        except (TypeError, ValueError) as e:
            return deferred_output(e, q, (0, 0), torch.float32)
        return torch.ops.sparse_mla.fp8_paged_mqa_logits(
            q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits, backend
        )
    _check_max_context_len(max_context_len)
    _check_bool(clean_logits, "clean_logits")
    max_context_len = int(max_context_len)
    h, d = _check_q(q, 4)
    dev = q.device
    b, next_n = q.shape[:2]
    if next_n < 1:
        raise ValueError(f"q: next_n (dim 1) must be >= 1, got shape {list(q.shape)}")
    check_index_cache(kv_cache, d)
    if kv_cache.device != dev:
        raise ValueError(f"kv_cache: expected a tensor on {dev} (where q is), got {kv_cache.device}")
    _check_weights(weights, b * next_n, h, dev, "b * next_n")
    ctx = _check_int_vector(context_lens, "context_lens", b, "b", dev)
    check_tensor_arg(block_table, "block_table", (torch.int32,), 2, dev)
    if block_table.shape[0] != b or block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected shape [b={b}, max_blocks >= 1], got {list(block_table.shape)}")
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    check_tensor_arg(schedule_meta, "schedule_meta", (torch.int32,), 1)
    if schedule_meta.shape[0] != 2:
        raise ValueError("schedule_meta: expected the tensor get_paged_mqa_logits_metadata() returns")
    if schedule_meta.device.type == "cpu" and int(schedule_meta[0]) != kv_cache.shape[1]:
        raise ValueError(
            f"schedule_meta: made for block_size {int(schedule_meta[0])}, but kv_cache has {kv_cache.shape[1]}"
        )
    kernels = INDEXER_BACKENDS.runs_kernels(dev, backend)
    if b == 0 or max_context_len == 0:
        return torch.full((b * next_n, max_context_len), float("-inf"), dtype=torch.float32, device=dev)
    if not kernels:
        return fp8_paged_mqa_logits_reference(q, kv_cache, weights, ctx, block_table, max_context_len)
    from .kernels import launch_paged_mqa_logits

    # the grid is sized for schedule_meta's SM count (read without a sync where it is on the CPU)
    num_sms = int(schedule_meta[1]) if schedule_meta.device.type == "cpu" else None
    out = torch.empty(b * next_n, max_context_len, dtype=torch.float32, device=dev)
    launch_paged_mqa_logits(_as_bytes(q), kv_cache, weights, ctx, block_table, out, max_context_len, num_sms)
    return out
