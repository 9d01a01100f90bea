"""Validation of a sparse prefill call (stage 1 of the prefill path): every argument checked, with
errors naming it, before anything runs; the result is a frozen :class:`PrefillProblem`."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import check_plain_storage, check_scale, check_tensor, check_vector, shape_of, shown
from ..decode.problem import MAX_H_Q
from ..formats import KVCacheLayout, check_cache, get_layout

__all__ = [
    "PrefillProblem",
    "validate_sparse_prefill",
    "check_prefill_scalars",
    "check_traced_prefill_args",
    "prefill_output_specs",
    "FP8_CACHE_DTYPES",
]

#: dtypes of an FP8 paged cache passed as ``kv`` (raw bytes or e4m3)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


@dataclass(frozen=True)
class PrefillProblem:
    """A validated sparse prefill call.

    Attributes:
        q: ``[s_q, h_q, d_qk]`` bf16, last dim contiguous.
        kv: ``[s_kv, 1, d_qk]`` bf16 (last dim contiguous), or an FP8 paged cache
            ``[num_blocks, page_block_size, 1, 656 | 584]`` (``kv_fp8``).
        indices: ``[s_q, 1, topk]`` int32 (rows of ``kv``, or cache slots when ``kv_fp8``).
        sm_scale: softmax scale (natural units).
        d_v: 512.
        attn_sink: ``[h_q]`` fp32, contiguous, or None.
        topk_length: ``[s_q]`` int32, contiguous, or None.
        kv_fp8: whether ``kv`` is the FP8 paged cache.
        layout: the cache layout of ``d_qk`` (V32 for 576, MODEL1 for 512).
    """

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    sm_scale: float
    d_v: int
    attn_sink: torch.Tensor | None
    topk_length: torch.Tensor | None
    kv_fp8: bool
    layout: KVCacheLayout

    @property
    def device(self) -> torch.device:
        """The device the call runs on (where ``q`` is)."""
        return self.q.device

    @property
    def s_q(self) -> int:
        return int(self.q.shape[0])

    @property
    def h_q(self) -> int:
        return int(self.q.shape[1])

    @property
    def topk(self) -> int:
        return int(self.indices.shape[2])

    @property
    def num_kv_rows(self) -> int:
        """Rows ``kv`` holds (``s_kv``, or ``num_blocks * page_block_size`` cache slots)."""
        if self.kv_fp8:
            return int(self.kv.shape[0]) * int(self.kv.shape[1])
        return int(self.kv.shape[0])


def _check_q(q: Any) -> KVCacheLayout:
    check_tensor(q, "q", (torch.bfloat16,), 3)
    _, h_q, d_qk = q.shape
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: expected a CPU or CUDA tensor, got one on {q.device}")
    if d_qk not in (576, 512):
        raise ValueError(f"q: head dim d_qk must be 576 (V3.2) or 512 (MODEL1), got {shown(d_qk)}")
    if not 1 <= h_q <= MAX_H_Q:
        raise ValueError(f"q: h_q must be in [1, {MAX_H_Q}], got shape {shape_of(q)}")
    if q.stride(-1) != 1:
        raise ValueError("q: the last dimension must be contiguous (stride 1)")
    return get_layout(d_qk)


def _check_kv(kv: Any, lay: KVCacheLayout, dev: torch.device) -> bool:
    """Check ``kv``; returns whether it is the FP8 paged cache."""
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv: expected a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype in FP8_CACHE_DTYPES:
        check_cache(kv, "kv", lay, dev)
        return True
    if kv.dtype != torch.bfloat16:
        raise TypeError(
            f"kv: expected bf16 [s_kv, 1, d_qk] or an FP8 paged cache (float8_e4m3fn or uint8 "
            f"[num_blocks, page_block_size, 1, {lay.bytes_per_token}]), got dtype {kv.dtype}"
        )
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != lay.d_qk:
        raise ValueError(f"kv: expected shape [s_kv, 1, d_qk={lay.d_qk}] (h_kv = 1), got {list(kv.shape)}")
    if kv.device != dev:
        raise ValueError(f"kv: expected a tensor on {dev} (where q is), got {kv.device}")
    if kv.stride(-1) != 1:
        raise ValueError("kv: the last dimension must be contiguous (stride 1)")
    check_plain_storage(kv, "kv")  # the kernels read its raw bits, inside its storage
    return False


def check_prefill_scalars(sm_scale: Any, d_v: Any, backend: Any = "auto") -> float:
    """The Python-number arguments: ``sm_scale`` (finite, > 0, also as float32), ``d_v`` (512) and
    ``backend`` (a str); returns ``sm_scale`` as a float."""
    scale = check_scale(sm_scale, "sm_scale")
    if isinstance(d_v, bool) or not isinstance(d_v, numbers.Integral) or d_v != 512:
        raise ValueError(f"d_v: expected 512, got {shown(d_v)!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    return scale


def check_traced_prefill_args(q: Any, sm_scale: Any, d_v: Any, backend: Any) -> float:
    """The prefill's checks that ``torch.compile`` can trace (the rest run in the operator, on the
    real tensors): ``q`` (its dtype and shape, which the operator's fake implementation reads) and
    the Python scalars (fixed in the graph); returns ``sm_scale`` as a float."""
    _check_q(q)
    return check_prefill_scalars(sm_scale, d_v, backend)


def prefill_output_specs(q: Any, kv: Any) -> tuple[list, torch.device]:
    """``([(out's shape, bf16), (max_logits', fp32), (lse's, fp32)], device)`` of a prefill call,
    for the outputs that stand in for a traced call's whose checks failed: the shapes from ``q``
    where it is a 3-D tensor (else empty), the device of ``q`` (else ``kv``'s, else the CPU)."""
    dev = torch.device("cpu")
    for x in (kv, q):
        if isinstance(x, torch.Tensor):
            dev = x.device
    s_q = h_q = 0
    if isinstance(q, torch.Tensor) and q.dim() == 3:
        s_q, h_q, _ = q.shape
    return [((s_q, h_q, 512), torch.bfloat16), ((s_q, h_q), torch.float32), ((s_q, h_q), torch.float32)], dev


def validate_sparse_prefill(
    q: Any,
    kv: Any,
    indices: Any,
    sm_scale: Any,
    d_v: Any = 512,
    attn_sink: Any = None,
    topk_length: Any = None,
) -> PrefillProblem:
    """Check a ``flash_mla_sparse_fwd`` call (see :func:`sparse_mla.flash_mla_sparse_fwd` for the
    contract) and return it as a :class:`PrefillProblem`; ``attn_sink`` and ``topk_length`` come
    back contiguous (a copy on the device for views).

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: a wrong shape, device, stride or value (the message names the argument).
    """
    lay = _check_q(q)
    s_q, h_q, _ = q.shape
    dev = q.device
    kv_fp8 = _check_kv(kv, lay, dev)
    check_tensor(indices, "indices", (torch.int32,), 3, dev)
    if indices.shape[0] != s_q or indices.shape[1] != 1:
        raise ValueError(f"indices: expected shape [s_q={s_q}, h_kv=1, topk], got {list(indices.shape)}")
    if indices.shape[2] < 1:
        raise ValueError(f"indices: topk must be >= 1, got {indices.shape[2]}")
    scale = check_prefill_scalars(sm_scale, d_v)
    attn_sink = check_vector(attn_sink, "attn_sink", torch.float32, h_q, "h_q", dev)
    topk_length = check_vector(topk_length, "topk_length", torch.int32, s_q, "s_q", dev)
    return PrefillProblem(q, kv, indices, scale, int(d_v), attn_sink, topk_length, kv_fp8, lay)
