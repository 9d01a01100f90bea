"""The validated description of a sparse decode call (stage 2 of the decode path; docs/design.md).

:func:`validate_sparse_decode` checks every argument before anything runs and returns a frozen
:class:`DecodeProblem`; a bad argument raises ``TypeError``/``ValueError`` naming it. Nothing
here knows about schedules, backends or kernels.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import (
    byte_range,
    check_no_self_overlap,
    check_scale,
    check_tensor,
    check_vector,
    shape_of,
    shape_text,
    shown,
)
from ..formats import KVCacheLayout, check_cache, get_layout

__all__ = [
    "DecodeProblem",
    "validate_sparse_decode",
    "check_tensor",
    "is_empty",
    "empty_outputs",
    "output_tensors",
    "finish_outputs",
    "into_buffers",
    "check_traced_decode_args",
    "decode_output_specs",
    "MAX_H_Q",
]

#: One KV head serves at most this many query heads.
MAX_H_Q = 128


@dataclass(frozen=True)
class DecodeProblem:
    """A validated sparse decode call: what the backends and the reference need.

    Attributes:
        q: ``[b, s_q, h_q, d_qk]`` bf16 (last dim contiguous).
        k_cache: ``[num_blocks, page_block_size, 1, bytes_per_token]`` fp8/uint8 cache.
        indices: ``[b, s_q, topk]`` int32 cache slots.
        layout: the cache layout (V32 for d_qk 576, MODEL1 for 512).
        sm_scale: softmax scale (natural units).
        d_v: value head dim (512).
        topk_length: ``[b]`` int32, contiguous, or None.
        attn_sink: ``[h_q]`` fp32, contiguous, or None.
        extra_k_cache: second cache of the same layout, or None.
        extra_indices: ``[b, s_q, extra_topk]`` int32 into ``extra_k_cache``, or None.
        extra_topk_length: ``[b]`` int32, contiguous, or None.
        out: caller's ``[b, s_q, h_q, d_v]`` bf16 output (last dim contiguous), or None.
        lse: caller's ``[b, h_q, s_q]`` fp32 output (any strides), or None.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    indices: torch.Tensor
    layout: KVCacheLayout
    sm_scale: float
    d_v: int
    topk_length: torch.Tensor | None = None
    attn_sink: torch.Tensor | None = None
    extra_k_cache: torch.Tensor | None = None
    extra_indices: torch.Tensor | None = None
    extra_topk_length: torch.Tensor | None = None
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(b, s_q, h_q, d_qk)``."""
        b, s_q, h_q, d_qk = self.q.shape
        return b, s_q, h_q, d_qk

    @property
    def topk(self) -> int:
        return self.indices.shape[2]

    @property
    def device(self) -> torch.device:
        """The device the call runs on (where ``q`` is)."""
        return self.q.device

    @property
    def extra_topk(self) -> int:
        """Indices per query into the extra cache (0 without one)."""
        return 0 if self.extra_indices is None else self.extra_indices.shape[2]


def _check_q(q: Any) -> KVCacheLayout:
    check_tensor(q, "q", (torch.bfloat16,), 4)
    _, _, h_q, d_qk = q.shape
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: expected a CPU or CUDA tensor (others follow q's device), got one on {q.device}")
    if d_qk not in (576, 512):
        raise ValueError(f"q: head dim d_qk must be 576 (V3.2 layout) or 512 (MODEL1 layout), got {d_qk}")
    if h_q < 1:
        raise ValueError(f"q: h_q must be >= 1, got shape {list(q.shape)}")
    if h_q > MAX_H_Q:
        raise ValueError(f"q: h_q must be <= {MAX_H_Q} (one KV head serves at most {MAX_H_Q} query heads), got {h_q}")
    if q.stride(-1) != 1:
        raise ValueError("q: the last dimension must be contiguous (stride 1)")
    return get_layout(d_qk)


def _check_flags(lay: KVCacheLayout, head_dim_v: Any, is_fp8_kvcache: Any, causal: Any) -> None:
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, numbers.Integral) or head_dim_v != lay.d_v:
        raise ValueError(f"head_dim_v: expected {lay.d_v}, got {shown(head_dim_v)!r}")
    if not is_fp8_kvcache:
        raise ValueError(
            "is_fp8_kvcache: the sparse decode (indices given) needs an FP8 cache; pass is_fp8_kvcache=True"
        )
    if causal:
        raise ValueError("causal: must be False for the sparse decode (the top-k indices already select the keys)")


def check_traced_decode_args(
    q: Any, indices: Any, head_dim_v: Any, softmax_scale: Any, is_fp8_kvcache: Any, causal: Any, out: Any, lse: Any
) -> float:
    """The decode's checks that ``torch.compile`` can trace (the rest run in the operator, on the
    real tensors): ``q``'s dtype and shape, the Python scalars (fixed in the graph), and the
    shape, dtype and device of the caller's ``out``/``lse`` (written by a copy after the operator,
    so their overlap with the inputs is not checked here); returns ``sm_scale``."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16:
        raise TypeError("q: expected a bf16 tensor [b, s_q, h_q, d_qk]")
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims [b, s_q, h_q, d_qk], got shape {shape_of(q)}")
    b, s_q, h_q, d_qk = q.shape
    if d_qk not in (576, 512):
        raise ValueError(f"q: head dim d_qk must be 576 (V3.2 layout) or 512 (MODEL1 layout), got {shown(d_qk)}")
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32:
        raise TypeError("indices: expected an int32 tensor [b, s_q, topk]")
    if indices.dim() != 3:
        raise ValueError(f"indices: expected 3 dims [b, s_q, topk], got shape {shape_of(indices)}")
    lay = get_layout(d_qk)
    _check_flags(lay, head_dim_v, is_fp8_kvcache, causal)
    sm_scale = _sm_scale(softmax_scale, d_qk)
    for buf, name, dtype, shape in (
        (out, "out", torch.bfloat16, (b, s_q, h_q, lay.d_v)),
        (lse, "lse", torch.float32, (b, h_q, s_q)),
    ):
        if buf is None:
            continue
        if not isinstance(buf, torch.Tensor) or buf.dtype != dtype:
            raise TypeError(f"{name}: expected a {dtype} tensor")
        if tuple(buf.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape_text(shape)}, got {shape_of(buf)}")
        if buf.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} (where q is), got {buf.device}")
    return sm_scale


def decode_output_specs(q: Any, indices: Any, k_cache: Any) -> tuple[list, torch.device]:
    """``([(out's shape, bf16), (lse's shape, fp32)], device)`` of a decode call, for the outputs
    that stand in for a traced call's whose checks failed: the shapes from ``q`` where it is a 4-D
    tensor (else empty), the device of the first tensor among ``q``, ``indices``, ``k_cache``
    (else the CPU)."""
    dev = torch.device("cpu")
    for x in (k_cache, indices, q):
        if isinstance(x, torch.Tensor):
            dev = x.device
    b = s_q = h_q = 0
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        b, s_q, h_q, _ = q.shape
    return [((b, s_q, h_q, 512), torch.bfloat16), ((b, h_q, s_q), torch.float32)], dev


def _sm_scale(softmax_scale: Any, d_qk: int) -> float:
    if softmax_scale is None:
        return d_qk**-0.5
    return check_scale(softmax_scale, "softmax_scale", "a float or None")


def _check_indices(ix: Any, name: str, b: int, s_q: int, dev: torch.device) -> None:
    check_tensor(ix, name, (torch.int32,), 3)
    if ix.shape[0] != b or ix.shape[1] != s_q:
        raise ValueError(f"{name}: expected shape [b={b}, s_q={s_q}, topk], got {list(ix.shape)}")
    if ix.shape[2] < 1:
        raise ValueError(f"{name}: topk must be >= 1, got {ix.shape[2]}")
    if ix.device != dev:
        raise ValueError(f"{name}: expected a tensor on {dev} (where q is), got {ix.device}")


def validate_sparse_decode(
    *,
    q: Any,
    k_cache: Any,
    indices: Any,
    head_dim_v: Any = 512,
    softmax_scale: Any = None,
    is_fp8_kvcache: Any = True,
    causal: Any = False,
    attn_sink: Any = None,
    extra_k_cache: Any = None,
    extra_indices_in_kvcache: Any = None,
    topk_length: Any = None,
    extra_topk_length: Any = None,
    out: Any = None,
    lse: Any = None,
) -> DecodeProblem:
    """Check every argument of the sparse decode (the arguments of
    :func:`sparse_mla.flash_mla_with_kvcache`); return the :class:`DecodeProblem`.

    The 1-D ``topk_length``, ``extra_topk_length`` and ``attn_sink`` come back contiguous (a copy
    on the device when a view was given); every other tensor's strides are honoured by the
    kernels. ``b = 0`` or ``s_q = 0`` is valid (an empty step). ``out``/``lse``, when given, are
    the caller's output buffers (written in place, returned; they must not overlap the inputs).

    Raises:
        TypeError / ValueError: naming the first bad argument.
    """
    lay = _check_q(q)
    b, s_q, h_q, d_qk = q.shape
    dev = q.device
    # the caller's tensors (not the contiguous copies made below): what out/lse must not overlap
    given = (q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
    _check_flags(lay, head_dim_v, is_fp8_kvcache, causal)
    sm_scale = _sm_scale(softmax_scale, d_qk)
    check_cache(k_cache, "k_cache", lay, dev)
    _check_indices(indices, "indices", b, s_q, dev)
    topk_length = check_vector(topk_length, "topk_length", torch.int32, b, "b", dev)
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache: give both or neither")
    if extra_k_cache is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_k_cache")
    if extra_k_cache is not None:
        check_cache(extra_k_cache, "extra_k_cache", lay, dev)
        _check_indices(extra_indices_in_kvcache, "extra_indices_in_kvcache", b, s_q, dev)
        extra_topk_length = check_vector(extra_topk_length, "extra_topk_length", torch.int32, b, "b", dev)
    attn_sink = check_vector(attn_sink, "attn_sink", torch.float32, h_q, "h_q", dev)
    if out is not None:
        check_tensor(out, "out", (torch.bfloat16,), 4, dev)
        if tuple(out.shape) != (b, s_q, h_q, lay.d_v):
            raise ValueError(f"out: expected shape [b={b}, s_q={s_q}, h_q={h_q}, d_v={lay.d_v}], got {list(out.shape)}")
        if out.stride(-1) != 1 and out.numel() > 0:
            raise ValueError("out: the last dimension must be contiguous (stride 1)")
        check_no_self_overlap(out, "out")
    if lse is not None:
        check_tensor(lse, "lse", (torch.float32,), 3, dev)
        if tuple(lse.shape) != (b, h_q, s_q):
            raise ValueError(f"lse: expected shape [b={b}, h_q={h_q}, s_q={s_q}], got {list(lse.shape)}")
        check_no_self_overlap(lse, "lse")
    if out is not None or lse is not None:
        call = (*given, out, lse)
        check_outputs_apart(call, relative_byte_ranges(call))
    return DecodeProblem(
        q=q,
        k_cache=k_cache,
        indices=indices,
        layout=lay,
        sm_scale=sm_scale,
        d_v=lay.d_v,
        topk_length=topk_length,
        attn_sink=attn_sink,
        extra_k_cache=extra_k_cache,
        extra_indices=extra_indices_in_kvcache,
        extra_topk_length=extra_topk_length,
        out=out,
        lse=lse,
    )


def is_empty(p: DecodeProblem) -> bool:
    """An empty step (``b = 0`` or ``s_q = 0``): nothing to schedule or launch."""
    return p.q.shape[0] == 0 or p.q.shape[1] == 0


def output_tensors(p: DecodeProblem, out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers a backend writes: the caller's ``p.out``/``p.lse`` where given, else new
    ``out [b, s_q, h_q, d_v]`` (``out_dtype``) and ``lse [b, h_q, s_q]`` fp32 tensors on q's device.
    (A backend that writes another dtype than the caller's ``out`` asks for a new one here and
    copies at the end.)"""
    b, s_q, h_q, _ = p.q.shape
    out = p.out
    if out is None or out.dtype != out_dtype:
        out = p.q.new_empty((b, s_q, h_q, p.d_v), dtype=out_dtype)
    lse = p.lse if p.lse is not None else p.q.new_empty((b, h_q, s_q), dtype=torch.float32)
    return out, lse


def finish_outputs(p: DecodeProblem, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` as the caller of ``p`` gets them: :func:`into_buffers` with ``p.out``/``p.lse``."""
    return into_buffers(p.out, p.lse, out, lse)


def into_buffers(
    out_buf: torch.Tensor | None, lse_buf: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` written into the caller's ``out_buf``/``lse_buf`` where given (a copy unless
    the backend wrote them already) and returned as those; ``out`` as bf16 otherwise."""
    if out_buf is not None:
        if out is not out_buf:
            out_buf.copy_(out)
        out = out_buf
    else:
        out = out.to(torch.bfloat16)
    if lse_buf is not None:
        if lse is not lse_buf:
            lse_buf.copy_(lse)
        lse = lse_buf
    return out, lse


def empty_outputs(p: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [b, s_q, h_q, d_v]`` bf16 and ``lse [b, h_q, s_q]`` fp32 of an empty step (no launch;
    the caller's ``out``/``lse`` when given)."""
    return output_tensors(p)


def relative_byte_ranges(tensors) -> tuple:
    """``((index, first - data_ptr, last - data_ptr), ...)`` for each non-empty tensor of
    ``tensors`` (the eight decode inputs, then ``out``, then ``lse``; None where not given): with
    the same shapes and strides, ``data_ptr + these`` are their byte ranges (what a repeated call
    with the same fingerprint needs for :func:`check_outputs_apart`)."""
    rel = []
    for i, t in enumerate(tensors):
        if t is not None and t.numel() > 0:
            lo, hi = byte_range(t)
            ptr = t.data_ptr()
            rel.append((i, lo - ptr, hi - ptr))
    return tuple(rel)


def check_outputs_apart(tensors, rel: tuple) -> None:
    """The overlap rule of the caller's output buffers (:func:`validate_sparse_decode`, and a repeated
    call with the validated call's shapes and strides, from which ``rel`` was computed:
    :func:`relative_byte_ranges`): ``out`` (index 8) must not
    overlap an input, ``lse`` (index 9) neither an input nor ``out``.

    Raises:
        ValueError: naming ``out`` or ``lse``.
    """
    seen = []
    for i, lo, hi in rel:
        ptr = tensors[i].data_ptr()
        lo += ptr
        hi += ptr
        if i >= 8:
            for olo, ohi in seen:
                if lo <= ohi and olo <= hi:
                    raise ValueError(
                        f"{'out' if i == 8 else 'lse'}: must not overlap an input or another output in memory"
                    )
        seen.append((lo, hi))
