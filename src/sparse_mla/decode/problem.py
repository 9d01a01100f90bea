"""The validated description of a decode call (stage 2 of the decode path; docs/design.md).

:func:`validate_sparse_decode` (``indices`` given) and :func:`validate_dense_decode` (``indices``
None: every position of each request's context, through its block table) check every argument
before anything runs and return a frozen :class:`DecodeProblem`; a bad argument raises
``TypeError``/``ValueError`` naming it. Nothing here knows about schedules, backends or kernels.

The dense decode is the sparse one whose list of request ``i`` is its positions
``0 .. cache_seqlens[i] - 1``: the problem keeps ``cache_seqlens`` as ``topk_length`` and the
block table's capacity ``max_blocks * page_block_size`` as ``topk``, so the schedule made from
lengths balances the partitions by context length.
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
    "validate_dense_decode",
    "check_dense_values",
    "refuse_sparse_extras",
    "check_tensor",
    "is_empty",
    "empty_outputs",
    "output_tensors",
    "finish_outputs",
    "into_buffers",
    "check_traced_decode_args",
    "check_traced_dense_args",
    "decode_output_specs",
    "dense_slots",
    "MAX_H_Q",
]

#: One KV head serves at most this many query heads.
MAX_H_Q = 128


@dataclass(frozen=True)
class DecodeProblem:
    """A validated decode call, sparse or dense: what the backends and the reference need.

    Attributes:
        q: ``[b, s_q, h_q, d_qk]`` bf16 (dense with a bf16/fp16 cache: bf16 or fp16; last dim
            contiguous).
        k_cache: ``[num_blocks, page_block_size, 1, bytes_per_token]`` fp8/uint8 cache, or (dense
            only) ``[num_blocks, page_block_size, 1, d_qk]`` rows of q's dtype.
        indices: ``[b, s_q, topk]`` int32 cache slots; None for the dense decode.
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
    block_table: torch.Tensor | None = None
    causal: bool = False

    @property
    def is_dense(self) -> bool:
        """The dense decode: every context position through ``block_table`` (no ``indices``);
        ``topk_length`` holds ``cache_seqlens``."""
        return self.indices is None

    @property
    def fp8_cache(self) -> bool:
        """The cache holds FP8 records (V32 / MODEL1 bytes), not rows of q's dtype."""
        return self.k_cache.dtype in (torch.float8_e4m3fn, torch.uint8)

    @property
    def cache_seqlens(self) -> torch.Tensor | None:
        """``[b]`` int32 context lengths of the dense decode (None for the sparse one)."""
        return self.topk_length if self.is_dense else None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(b, s_q, h_q, d_qk)``."""
        b, s_q, h_q, d_qk = self.q.shape
        return b, s_q, h_q, d_qk

    @property
    def topk(self) -> int:
        """Slots of a request's list: ``indices``'s last dim, or for the dense decode the block
        table's capacity ``max_blocks * page_block_size``."""
        if self.indices is None:
            return self.block_table.shape[1] * self.k_cache.shape[1]
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
    return _check_q_shape(q)


def _check_q_shape(q: torch.Tensor) -> KVCacheLayout:
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
    _check_traced_buffers(out, lse, q, lay.d_v)
    return sm_scale


def _check_traced_buffers(out: Any, lse: Any, q: torch.Tensor, d_v: int) -> None:
    """The traceable checks of the caller's ``out`` (q's dtype) and ``lse`` (fp32) buffers: dtype,
    shape and device (their overlap with the inputs is checked by the operator)."""
    b, s_q, h_q, _ = q.shape
    for buf, name, dtype, shape in (
        (out, "out", q.dtype, (b, s_q, h_q, d_v)),
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


def check_traced_dense_args(
    q: Any,
    k_cache: Any,
    block_table: Any,
    head_dim_v: Any,
    softmax_scale: Any,
    is_fp8_kvcache: Any,
    causal: Any,
    out: Any,
    lse: Any,
) -> float:
    """The dense decode's checks that ``torch.compile`` can trace (the operator checks the rest,
    values included, when it runs): ``q``'s dtype and shape, ``block_table``'s dtype and rank, the
    Python scalars, the caller's ``out``/``lse`` shapes and dtypes; returns ``sm_scale``."""
    if not isinstance(q, torch.Tensor) or q.dtype not in DENSE_DTYPES:
        raise TypeError("q: expected a bf16 or fp16 tensor [b, s_q, h_q, d_qk]")
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims [b, s_q, h_q, d_qk], got shape {shape_of(q)}")
    b, s_q, h_q, d_qk = q.shape
    if d_qk not in (576, 512):
        raise ValueError(f"q: head dim d_qk must be 576 (V3.2 layout) or 512 (MODEL1 layout), got {shown(d_qk)}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        raise TypeError("block_table: expected an int32 tensor [b, max_blocks]")
    if block_table.dim() != 2:
        raise ValueError(f"block_table: expected a 2-D tensor, got shape {shape_of(block_table)}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise TypeError("k_cache: expected a 4-D tensor [num_blocks, page_block_size, 1, bytes or d_qk]")
    lay = get_layout(d_qk)
    _check_dense_flags(lay, head_dim_v, is_fp8_kvcache, causal)
    sm_scale = _sm_scale(softmax_scale, d_qk)
    _check_traced_buffers(out, lse, q, lay.d_v)
    return sm_scale


def _check_dense_flags(lay: KVCacheLayout, head_dim_v: Any, is_fp8_kvcache: Any, causal: Any) -> None:
    """The dense decode's ``head_dim_v`` (the layout's d_v) and its two bool flags."""
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, numbers.Integral) or head_dim_v != lay.d_v:
        raise ValueError(f"head_dim_v: expected {lay.d_v}, got {shown(head_dim_v)!r}")
    for name, v in (("is_fp8_kvcache", is_fp8_kvcache), ("causal", causal)):
        if not isinstance(v, bool):
            raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")


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
    out_dtype = q.dtype if isinstance(q, torch.Tensor) and q.dtype in DENSE_DTYPES else torch.bfloat16
    return [((b, s_q, h_q, 512), out_dtype), ((b, h_q, s_q), torch.float32)], dev


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
    _check_out_lse(out, lse, q, lay.d_v, given)
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


#: the dtypes of q (and of a bf16/fp16 cache) the dense decode takes
DENSE_DTYPES = (torch.bfloat16, torch.float16)


def _check_dense_cache(k_cache: Any, q: torch.Tensor, lay: KVCacheLayout, is_fp8_kvcache: Any) -> None:
    """The dense decode's cache: the FP8 records of ``lay`` (``is_fp8_kvcache``; q bf16), else rows
    ``[num_blocks, page_block_size, 1, d_qk]`` of q's dtype whose last dim is contiguous."""
    dev = q.device
    if is_fp8_kvcache:
        if q.dtype != torch.bfloat16:
            raise TypeError(f"q: the FP8 cache (is_fp8_kvcache=True) needs bf16 queries, got {q.dtype}")
        check_cache(k_cache, "k_cache", lay, dev)
        _check_slot_count(k_cache)
        return
    d_qk = q.shape[-1]
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache: expected a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dtype in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"k_cache: an FP8 cache ({k_cache.dtype}) needs is_fp8_kvcache=True")
    if k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache: expected dtype {q.dtype} (q's dtype; is_fp8_kvcache=False), got {k_cache.dtype}")
    check_tensor(k_cache, "k_cache", (q.dtype,), 4, dev)
    nb, pbs, h_kv, d = k_cache.shape
    if h_kv != 1:
        raise ValueError(f"k_cache: h_kv (dim 2) must be 1 for MLA, got {h_kv}")
    if d != d_qk:
        raise ValueError(f"k_cache: expected head dim {d_qk} (q's d_qk) in dim 3, got shape {shape_of(k_cache)}")
    if nb < 1 or pbs < 1:
        raise ValueError(f"k_cache: needs at least one block of at least one token, got {shape_of(k_cache)}")
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache: the last dimension must be contiguous (stride 1)")
    _check_slot_count(k_cache)


def _check_slot_count(k_cache: torch.Tensor) -> None:
    """The dense decode addresses a token as ``block * page_block_size + offset`` in int32 (as
    FlashMLA's indices do): a cache (or an expanded view of one) of more slots is refused."""
    slots = k_cache.shape[0] * k_cache.shape[1]
    if slots > 2**31 - 1:
        raise ValueError(
            f"k_cache: {k_cache.shape[0]} blocks x page_block_size {k_cache.shape[1]} = {slots} token slots, "
            f"more than the 2^31 - 1 the decode addresses (int32 slots)"
        )


def check_dense_values(p: DecodeProblem) -> None:
    """The values of a dense problem's ``cache_seqlens`` and ``block_table`` (read on the host):
    every length in ``[0, max_blocks * page_block_size]``, with ``causal`` and ``s_q > 1`` either 0
    or at least ``s_q``, and the block-table entries a request uses (``j < ceil(len / page_block_size)``)
    in ``[0, num_blocks)``. Entries past a request's length are never read and may hold anything.

    Raises:
        ValueError: naming ``cache_seqlens`` or ``block_table``.
    """
    lens, bt = p.topk_length, p.block_table
    if lens.numel() == 0:
        return
    num_blocks, pbs = p.k_cache.shape[0], p.k_cache.shape[1]
    cap = bt.shape[1] * pbs
    s_q = p.q.shape[1]
    lo, hi = lens.min().item(), lens.max().item()
    if lo < 0:
        raise ValueError(f"cache_seqlens: expected lengths >= 0, got {lo}")
    if hi > cap:
        raise ValueError(
            f"cache_seqlens: a length of {hi} is more than block_table holds "
            f"(max_blocks {bt.shape[1]} * page_block_size {pbs} = {cap})"
        )
    if p.causal and s_q > 1:
        short = (lens > 0) & (lens < s_q)
        if bool(short.any()):
            raise ValueError(
                f"cache_seqlens: with causal=True each length must be 0 or at least s_q={s_q} (a query token "
                f"attends the positions up to its own), got {int(lens[short][0])}"
            )
    used = torch.arange(bt.shape[1], device=bt.device)[None, :] < ((lens.long() + pbs - 1) // pbs)[:, None]
    bad = used & ((bt < 0) | (bt >= num_blocks))
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"block_table: entry [{i}, {j}] = {int(bt[i, j])} is used by cache_seqlens[{i}] = {int(lens[i])} "
            f"but outside [0, num_blocks={num_blocks})"
        )


def refuse_sparse_extras(attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length) -> None:
    """The dense decode takes none of the sparse decode's extras: ``ValueError`` naming the first given."""
    for name, v in (
        ("attn_sink", attn_sink),
        ("extra_k_cache", extra_k_cache),
        ("extra_indices_in_kvcache", extra_indices_in_kvcache),
        ("topk_length", topk_length),
        ("extra_topk_length", extra_topk_length),
    ):
        if v is not None:
            raise ValueError(f"{name}: only the sparse decode (indices given) takes it; the dense decode got one")


def _check_out_lse(out: Any, lse: Any, q: torch.Tensor, d_v: int, inputs: tuple) -> None:
    """The caller's ``out [b, s_q, h_q, d_v]`` (q's dtype, last dim contiguous) and ``lse
    [b, h_q, s_q]`` fp32 buffers, apart from the call's eight ``inputs`` (in
    :func:`check_outputs_apart`'s order, None where not given) and from each other."""
    b, s_q, h_q, _ = q.shape
    dev = q.device
    if out is not None:
        check_tensor(out, "out", (q.dtype,), 4, dev)
        if tuple(out.shape) != (b, s_q, h_q, d_v):
            raise ValueError(f"out: expected shape [b={b}, s_q={s_q}, h_q={h_q}, d_v={d_v}], got {list(out.shape)}")
        if out.stride(-1) != 1 and out.numel() > 0:
            raise ValueError("out: the last dimension must be contiguous (stride 1)")
        check_no_self_overlap(out, "out")
    if lse is not None:
        check_tensor(lse, "lse", (torch.float32,), 3, dev)
        if tuple(lse.shape) != (b, h_q, s_q):
            raise ValueError(f"lse: expected shape [b={b}, h_q={h_q}, s_q={s_q}], got {list(lse.shape)}")
        check_no_self_overlap(lse, "lse")
    if out is not None or lse is not None:
        call = (*inputs, out, lse)
        check_outputs_apart(call, relative_byte_ranges(call))


def _values_readable(t: torch.Tensor) -> bool:
    """Whether validation may read ``t``'s values on the host: always on the CPU, on CUDA unless
    the stream is being captured into a graph (a read there is impossible)."""
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def validate_dense_decode(
    *,
    q: Any,
    k_cache: Any,
    block_table: Any,
    cache_seqlens: Any,
    head_dim_v: Any = 512,
    softmax_scale: Any = None,
    is_fp8_kvcache: Any = False,
    causal: Any = False,
    attn_sink: Any = None,
    extra_k_cache: Any = None,
    extra_indices_in_kvcache: Any = None,
    topk_length: Any = None,
    extra_topk_length: Any = None,
    out: Any = None,
    lse: Any = None,
    read_values: bool = True,
) -> DecodeProblem:
    """Check every argument of the dense decode (:func:`sparse_mla.flash_mla_with_kvcache` without
    ``indices``); return the :class:`DecodeProblem` (``indices`` None, ``topk_length`` the
    contiguous ``cache_seqlens``).

    The values of ``cache_seqlens`` and of the block-table entries they use are checked
    (:func:`check_dense_values`; with ``read_values``, except while a CUDA graph is being
    captured: on a GPU a host synchronisation); the kernels stay inside the cache whatever they
    hold (lengths clamped to the table, entries outside the cache read as no token).

    Raises:
        TypeError / ValueError: naming the first bad argument.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in DENSE_DTYPES:
        raise TypeError(f"q: expected dtype torch.bfloat16 or torch.float16, got {q.dtype}")
    check_tensor(q, "q", DENSE_DTYPES, 4)
    lay = _check_q_shape(q)
    b, s_q, h_q, d_qk = q.shape
    dev = q.device
    given = (q, k_cache, block_table, cache_seqlens)  # (the caller's: what out/lse must not overlap)
    _check_dense_flags(lay, head_dim_v, is_fp8_kvcache, causal)
    sm_scale = _sm_scale(softmax_scale, d_qk)
    refuse_sparse_extras(attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)
    _check_dense_cache(k_cache, q, lay, is_fp8_kvcache)
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        got = block_table.dtype if isinstance(block_table, torch.Tensor) else type(block_table).__name__
        raise TypeError(f"block_table: expected an int32 tensor [b, max_blocks], got {got}")
    check_tensor(block_table, "block_table", (torch.int32,), 2, dev)
    if block_table.shape[0] != b:
        raise ValueError(f"block_table: expected shape [b={b}, max_blocks], got {shape_of(block_table)}")
    if cache_seqlens is None:
        raise TypeError("cache_seqlens: expected an int32 tensor [b] (the dense decode needs it), got None")
    cache_seqlens = check_vector(cache_seqlens, "cache_seqlens", torch.int32, b, "b", dev)
    _check_out_lse(out, lse, q, lay.d_v, (*given, None, None, None, None))
    p = DecodeProblem(
        q=q,
        k_cache=k_cache,
        indices=None,
        layout=lay,
        sm_scale=sm_scale,
        d_v=lay.d_v,
        topk_length=cache_seqlens,
        out=out,
        lse=lse,
        block_table=block_table,
        causal=causal,
    )
    if read_values and _values_readable(cache_seqlens):
        check_dense_values(p)
    return p


def dense_slots(
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    num_blocks: int,
    page_block_size: int,
    s_q: int,
    causal: bool,
) -> torch.Tensor:
    """The dense decode's positions as sparse-decode indices: ``[b, s_q, cap]`` int32 cache slots
    (``cap = max_blocks * page_block_size``) on the block table's device, ``-1`` where a query
    token attends nothing.

    Position ``t`` of request ``i`` is slot ``block_table[i, t // page_block_size] *
    page_block_size + t % page_block_size``; query token ``j`` attends ``t < cache_seqlens[i]``
    (causal: ``t < cache_seqlens[i] - s_q + j + 1``), and only where the block-table entry lies in
    ``[0, num_blocks)`` (the entries past a request's length may hold anything). Slots fit int32
    (the cache holds fewer than 2^31 tokens: checked when the call is validated). Torch ops only:
    graph-safe, no host synchronisation."""
    b, max_blocks = block_table.shape
    cap = max_blocks * page_block_size
    dev = block_table.device
    pos = torch.arange(cap, device=dev, dtype=torch.int64)
    phys = block_table.long()[:, pos // page_block_size]  # [b, cap]
    in_cache = (phys >= 0) & (phys < num_blocks)
    limit = cache_seqlens.to(dev).long().clamp(0, cap).view(b, 1).expand(b, s_q)
    if causal:
        limit = limit - (s_q - 1) + torch.arange(s_q, device=dev).view(1, s_q)
    valid = (pos.view(1, 1, cap) < limit.unsqueeze(-1)) & in_cache.unsqueeze(1)  # [b, s_q, cap]
    slots = torch.where(in_cache, phys * page_block_size + pos % page_block_size, -1)
    return torch.where(valid, slots.unsqueeze(1), -1).to(torch.int32)


def is_empty(p: DecodeProblem) -> bool:
    """An empty step (``b = 0`` or ``s_q = 0``): nothing to schedule or launch."""
    return p.q.shape[0] == 0 or p.q.shape[1] == 0


def output_tensors(p: DecodeProblem, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers a backend writes: the caller's ``p.out``/``p.lse`` where given, else new
    ``out [b, s_q, h_q, d_v]`` (``out_dtype``, default q's dtype) and ``lse [b, h_q, s_q]`` fp32
    tensors on q's device. (A backend that writes another dtype than the caller's ``out`` asks for
    a new one here and copies at the end.)"""
    b, s_q, h_q, _ = p.q.shape
    out_dtype = p.q.dtype if out_dtype is None else out_dtype
    out = p.out
    if out is None or out.dtype != out_dtype:
        out = p.q.new_empty((b, s_q, h_q, p.d_v), dtype=out_dtype)
    lse = p.lse if p.lse is not None else p.q.new_empty((b, h_q, s_q), dtype=torch.float32)
    return out, lse


def finish_outputs(p: DecodeProblem, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` as the caller of ``p`` gets them: :func:`into_buffers` with ``p.out``/``p.lse``
    (``out`` in q's dtype)."""
    return into_buffers(p.out, p.lse, out, lse, p.q.dtype)


def into_buffers(
    out_buf: torch.Tensor | None,
    lse_buf: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` written into the caller's ``out_buf``/``lse_buf`` where given (a copy unless
    the backend wrote them already) and returned as those; ``out`` as ``dtype`` otherwise."""
    if out_buf is not None:
        if out is not out_buf:
            out_buf.copy_(out)
        out = out_buf
    else:
        out = out.to(dtype)
    if lse_buf is not None:
        if lse is not lse_buf:
            lse_buf.copy_(lse)
        lse = lse_buf
    return out, lse


def empty_outputs(p: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [b, s_q, h_q, d_v]`` (q's dtype) and ``lse [b, h_q, s_q]`` fp32 of an empty step (no launch;
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
