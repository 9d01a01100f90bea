"""The decode's ``torch.library`` custom ops (``torch.ops.sparse_mla.*``), each with a fake (meta)
implementation, so that they can be traced by ``torch.compile`` (``fullgraph=True``) and captured
in CUDA graphs:

=======================================================  =========================================
``sparse_mla::sparse_decode``                            FP8 sparse decode (split-KV + combine)
``sparse_mla::dense_decode``                             dense decode over a block table (the
                                                         same split-KV + combine)
``sparse_mla::combine``                                  LSE-weighted merge of split results
                                                         (mutates ``out``, ``lse``)
=======================================================  =========================================

A custom op cannot take the :class:`~sparse_mla.decode.plan.FlashMLASchedMeta` object, so
``sparse_mla::sparse_decode`` takes the scheduler's tensors (``tile_scheduler_metadata``,
``acc_rows``, ``main_blocks``, ``num_blocks``), the ``any_split`` flag and the backend's name
(:func:`schedule_tensors` gives them for a filled scheduler object). With ``topk_length`` or
``extra_topk_length`` the op makes the schedule of those lengths on the device, and the tensors
only give its partition count (``tile_scheduler_metadata.shape[0]``);
:func:`sparse_mla.decode.eager.sparse_decode` is the convenient entry point.
:func:`sparse_mla.flash_mla_with_kvcache` calls the op when it is being compiled
(:func:`traced_sparse_decode`); eager calls skip the dispatcher's overhead and run the same code
(:mod:`.eager`). ``sparse_mla::dense_decode`` always schedules on the device from ``cache_seqlens``:
it takes ``tile_scheduler_metadata`` for its partition count only.

Each op runs the Triton kernels on CUDA and under ``TRITON_INTERPRET=1``, and the PyTorch
reference otherwise (CPU without the interpreter). Importing this module imports neither Triton nor
the kernels: they are imported when an op first runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core.checks import check_no_self_overlap, check_plain_storage, shown
from ..core.env import use_triton
from .backends import dynamic_table, get_backend, resolve_backend, run_decode
from .plan import DecodePlan, FlashMLASchedMeta, check_plan_belongs, check_sched_meta
from .problem import (
    DecodeProblem,
    check_outputs_apart,
    empty_outputs,
    is_empty,
    relative_byte_ranges,
    validate_dense_decode,
    validate_sparse_decode,
)
from .scheduler import MAX_ACC_ROWS_PER_PART, META_FIELDS, TOPK_BLOCK_SIZE, ScheduleTable

__all__ = [
    "schedule_tensors",
    "combine",
    "traced_sparse_decode",
    "check_traced_plan",
    "call_sparse_decode_op",
    "call_dense_decode_op",
    "traced_dense_decode",
    "bound_schedule_tensors",
    "OPS",
]

#: the registered operator names
OPS = ("sparse_mla::sparse_decode", "sparse_mla::dense_decode", "sparse_mla::combine")

D_V = 512


def _check_sched_tensors(
    q: torch.Tensor,
    metadata: torch.Tensor,
    acc_rows: torch.Tensor,
    main_blocks: torch.Tensor,
    num_blocks: torch.Tensor,
) -> None:
    b = q.shape[0]
    _check_metadata(q, metadata)
    for name, t, shape in (
        ("acc_rows", acc_rows, (b + 1,)),
        ("main_blocks", main_blocks, (b,)),
        ("num_blocks", num_blocks, (b,)),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            raise TypeError(f"{name}: expected an int32 tensor")
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} (where q is), got {t.device}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")


def _check_metadata(q: torch.Tensor, metadata: torch.Tensor) -> None:
    """``tile_scheduler_metadata [num_sm_parts >= 1, 8]`` int32 on q's device."""
    if not isinstance(metadata, torch.Tensor) or metadata.dtype != torch.int32:
        raise TypeError("tile_scheduler_metadata: expected an int32 tensor")
    if metadata.device != q.device:
        raise ValueError(
            f"tile_scheduler_metadata: expected a tensor on {q.device} (where q is), got {metadata.device}"
        )
    if metadata.dim() != 2 or metadata.shape[1] != len(META_FIELDS) or metadata.shape[0] < 1:
        raise ValueError(
            f"tile_scheduler_metadata: expected shape [num_sm_parts >= 1, {len(META_FIELDS)}], got {list(metadata.shape)}"
        )


def bound_schedule_tensors(
    metadata: torch.Tensor,
    acc_rows: torch.Tensor,
    main_blocks: torch.Tensor,
    num_blocks: torch.Tensor,
    b: int,
    topk: int,
    extra_topk: int,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scheduler tensors clamped to what the kernels can address (device ops only, no sync).

    Tensors made by the scheduler come back unchanged. Forged ones cannot make a kernel read or
    write out of bounds or loop without end afterwards: requests stay in ``[0, b)``, blocks in
    ``[0, ceil(topk/64) + ceil(extra_topk/64)]``, ``acc_rows`` becomes a non-decreasing
    sequence from 0 within ``[0, rows - 1]`` and split indices stay inside their batch's rows.
    The results are contiguous whatever the inputs' strides (the kernels index them densely).
    """
    bs = TOPK_BLOCK_SIZE
    main_max = -(-topk // bs)
    blk_max = main_max + (-(-extra_topk // bs))
    mb = main_blocks.clamp(0, main_max).contiguous()
    nb = torch.maximum(num_blocks.clamp(0, blk_max), mb).contiguous()
    ns = acc_rows.clamp(0, rows - 1)
    ns = torch.cummax(ns, dim=0).values
    ns = torch.cat([ns.new_zeros(1), ns[1:]])
    md = metadata.clone(memory_format=torch.contiguous_format)
    md[:, 0] = metadata[:, 0].clamp(0, b)  # begin_req (b = idle)
    md[:, 1] = metadata[:, 1].clamp(-1, b - 1)  # end_req
    md[:, 2] = metadata[:, 2].clamp(0, blk_max)
    md[:, 3] = metadata[:, 3].clamp(0, blk_max)
    first = md[:, 0].clamp(max=b - 1).long()
    n_first = (ns[first + 1] - ns[first]).clamp(min=1)
    md[:, 4] = torch.minimum(metadata[:, 4].clamp(min=0), n_first - 1)  # begin_split
    return md, ns, mb, nb


# --------------------------------------------------------------------------------------------
# sparse_mla::sparse_decode


@torch.library.custom_op("sparse_mla::sparse_decode", mutates_args=())
def _sparse_decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    tile_scheduler_metadata: torch.Tensor,
    acc_rows: torch.Tensor,
    main_blocks: torch.Tensor,
    num_blocks: torch.Tensor,
    any_split: bool,
    sm_scale: float,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    p = validate_sparse_decode(
        q=q,
        k_cache=k_cache,
        indices=indices,
        head_dim_v=D_V,
        softmax_scale=sm_scale,
        attn_sink=attn_sink,
        extra_k_cache=extra_k_cache,
        extra_indices_in_kvcache=extra_indices,
        topk_length=topk_length,
        extra_topk_length=extra_topk_length,
    )
    if is_empty(p):
        resolve_backend(p, backend)  # checked on an empty step too
        return empty_outputs(p)
    _check_sched_tensors(q, tile_scheduler_metadata, acc_rows, main_blocks, num_blocks)
    b = q.shape[0]
    parts = int(tile_scheduler_metadata.shape[0])
    if topk_length is not None or extra_topk_length is not None:
        # the schedule of these lengths is made on the device (the tensors give its partition count)
        table = dynamic_table(b, parts, q.device)
        return run_decode(p, resolve_backend(p, backend), table, own_table=True)
    rows = MAX_ACC_ROWS_PER_PART * parts + 1
    extra_topk = 0 if extra_indices is None else extra_indices.shape[2]
    bounded = bound_schedule_tensors(
        tile_scheduler_metadata, acc_rows, main_blocks, num_blocks, b, indices.shape[2], extra_topk, rows
    )
    on_host = q.device.type == "cpu"
    if on_host:
        # checkable without a sync: values the scheduler cannot have made are an error here
        for name, t, ok in zip(
            ("tile_scheduler_metadata", "acc_rows", "main_blocks", "num_blocks"),
            (tile_scheduler_metadata, acc_rows, main_blocks, num_blocks),
            bounded,
            strict=True,
        ):
            if not torch.equal(t, ok):
                raise ValueError(
                    f"{name}: values out of range for this call (use schedule_tensors() of a filled scheduler)"
                )
        # and block counts that no scheduler fill for this call's topk (and extra_topk) makes: the
        # ones the lengths do not change are fixed (a schedule of another topk ran silently before)
        main_h, total_h = main_blocks.long(), num_blocks.long()
        main_full = -(-indices.shape[2] // TOPK_BLOCK_SIZE)
        extra_full = -(-extra_topk // TOPK_BLOCK_SIZE)
        if topk_length is None and bool((main_h != main_full).any()):
            raise ValueError(
                f"main_blocks: expected {main_full} per batch for topk {indices.shape[2]} without topk_length "
                "(use schedule_tensors() of the scheduler filled for this call)"
            )
        if extra_indices is None or extra_topk_length is None:
            want_nb = torch.clamp(main_h + (extra_full if extra_indices is not None else 0), min=1)
            if not torch.equal(total_h, want_nb):
                raise ValueError(
                    "num_blocks: not the block counts of this call's topk / extra_topk "
                    "(use schedule_tensors() of the scheduler filled for this call)"
                )
        split = int(acc_rows[-1]) > 0
        if split and not any_split:
            raise ValueError("any_split: False, but acc_rows says some batch is split (pass True)")
    else:
        # cannot be checked without a host sync: a wrong False would let the kernel write split
        # rows past 1-row accumulators, so off the host the accumulators are always allocated
        any_split = True
    # on the device the kernels get the bounded tensors: equal to the inputs when those came from
    # the scheduler, and memory-safe when they did not
    md, ns_t, mb, nb = bounded
    table = ScheduleTable(
        num_sm_parts=parts,
        metadata=md,
        num_splits=ns_t,
        main_blocks=mb,
        num_blocks=num_blocks.tolist() if on_host else [],
        payload=0,
        num_blocks_t=nb,
        acc_rows=ns_t,
        num_acc_rows=int(ns_t[-1]) if on_host else (rows - 1 if any_split else 0),
    )
    return run_decode(p, resolve_backend(p, backend), table)


@_sparse_decode_op.register_fake
def _(
    q,
    k_cache,
    indices,
    tile_scheduler_metadata,
    acc_rows,
    main_blocks,
    num_blocks,
    any_split,
    sm_scale,
    topk_length=None,
    attn_sink=None,
    extra_k_cache=None,
    extra_indices=None,
    extra_topk_length=None,
    backend="auto",
):
    b, s_q, h_q, _ = q.shape
    out = q.new_empty((b, s_q, h_q, D_V), dtype=torch.bfloat16)
    lse = q.new_empty((b, h_q, s_q), dtype=torch.float32)
    return out, lse


def schedule_tensors(tile_scheduler_metadata: FlashMLASchedMeta) -> dict:
    """The keyword arguments of ``torch.ops.sparse_mla.sparse_decode`` held by a filled scheduler object.

    Returns ``{"tile_scheduler_metadata": [num_sm_parts, 8] int32, "acc_rows": [b + 1] int32,
    "main_blocks": [b] int32, "num_blocks": [b] int32, "any_split": bool, "backend": str}``.

    Raises:
        TypeError: not a ``FlashMLASchedMeta``.
        ValueError: the object has not been filled yet (run one call first).
    """
    check_sched_meta(tile_scheduler_metadata)
    plan = tile_scheduler_metadata.plan
    if not tile_scheduler_metadata.have_initialized or plan is None:
        raise ValueError(
            "tile_scheduler_metadata: not filled yet; call sparse_decode (or flash_mla_with_kvcache) once first"
        )
    return _plan_tensors(plan)


def _plan_tensors(plan: DecodePlan) -> dict:
    t = plan.table
    return dict(
        tile_scheduler_metadata=t.metadata,
        acc_rows=t.acc_rows,
        main_blocks=t.main_blocks,
        num_blocks=t.num_blocks_t,
        any_split=t.any_split,
        backend=plan.backend.name,
    )


def call_sparse_decode_op(p: DecodeProblem, plan: DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.sparse_mla.sparse_decode`` on a validated problem and its plan."""
    return torch.ops.sparse_mla.sparse_decode(
        p.q,
        p.k_cache,
        p.indices,
        **_plan_tensors(plan),
        sm_scale=p.sm_scale,
        topk_length=p.topk_length,
        attn_sink=p.attn_sink,
        extra_k_cache=p.extra_k_cache,
        extra_indices=p.extra_indices,
        extra_topk_length=p.extra_topk_length,
    )


def check_traced_plan(
    q: torch.Tensor,
    indices: torch.Tensor,
    tile_scheduler_metadata: FlashMLASchedMeta,
    topk_length: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    backend: str = "auto",
    dense_topk: Optional[int] = None,
) -> DecodePlan:
    """The plan a traced decode runs: that of an already filled scheduler object, which must have
    been filled for this call's configuration (shapes, optional arguments, device, backend:
    compared while tracing, as an eager call does). The dense decode passes ``indices`` None,
    ``cache_seqlens`` as ``topk_length`` and its block table's capacity as ``dense_topk``.

    Raises:
        TypeError: ``tile_scheduler_metadata`` is not a ``FlashMLASchedMeta``.
        ValueError: it is not filled yet, or was filled for another configuration.
    """
    meta = check_sched_meta(tile_scheduler_metadata)
    if not isinstance(backend, str) or backend != "auto":
        get_backend(backend)  # an unknown name is named as such, as in an eager call
    plan = meta.plan
    if plan is None and meta.config is None:
        raise ValueError(
            "tile_scheduler_metadata: not filled yet; torch.compile cannot trace its first fill (it chooses "
            "the backend and allocates the workspace): make one eager call with it before the compiled one"
        )
    check_plan_belongs(meta)
    b, s_q, h_q, d_qk = q.shape
    now = dict(
        b=b, s_q=s_q, h_q=h_q, d_qk=d_qk, topk=indices.shape[-1] if indices is not None else dense_topk,
        has_topk_length=topk_length is not None,
        extra_topk=0 if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1],
        has_extra_topk_length=extra_topk_length is not None, device=str(q.device), backend=backend,
        dense=indices is None,
    )  # fmt: skip
    changed = ", ".join(
        f"{k} {getattr(meta.config, k)!r} -> {shown(v)!r}" for k, v in now.items() if getattr(meta.config, k) != v
    )
    if changed:
        raise ValueError(
            f"tile_scheduler_metadata: this object was filled for another configuration ({changed}); "
            "call get_mla_metadata() again for a new one"
        )
    return plan


def traced_sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    tile_scheduler_metadata: FlashMLASchedMeta,
    softmax_scale: Optional[float] = None,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode as ``torch.compile`` traces it: straight to the custom op, with the plan of
    :func:`check_traced_plan`. The op validates every argument when it runs (the checks read
    storage offsets and sizes, which the tracer cannot follow)."""
    plan = check_traced_plan(
        q, indices, tile_scheduler_metadata, topk_length, extra_indices_in_kvcache, extra_topk_length, backend
    )
    sm_scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return torch.ops.sparse_mla.sparse_decode(
        q,
        k_cache,
        indices,
        **_plan_tensors(plan),
        sm_scale=sm_scale,
        topk_length=topk_length,
        attn_sink=attn_sink,
        extra_k_cache=extra_k_cache,
        extra_indices=extra_indices_in_kvcache,
        extra_topk_length=extra_topk_length,
    )


# --------------------------------------------------------------------------------------------
# sparse_mla::dense_decode


@torch.library.custom_op("sparse_mla::dense_decode", mutates_args=())
def _dense_decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tile_scheduler_metadata: torch.Tensor,
    sm_scale: float,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    p = validate_dense_decode(
        q=q,
        k_cache=k_cache,
        block_table=block_table,
        cache_seqlens=cache_seqlens,
        head_dim_v=D_V,
        softmax_scale=sm_scale,
        is_fp8_kvcache=is_fp8_kvcache,
        causal=causal,
        read_values=q.device.type == "cpu",  # (no host synchronisation in a compiled graph on the GPU)
    )
    if is_empty(p):
        resolve_backend(p, backend)  # checked on an empty step too
        return empty_outputs(p)
    _check_metadata(q, tile_scheduler_metadata)
    # the schedule of these lengths is made on the device (the tensor gives its partition count)
    table = dynamic_table(q.shape[0], int(tile_scheduler_metadata.shape[0]), q.device)
    return run_decode(p, resolve_backend(p, backend), table, own_table=True)


@_dense_decode_op.register_fake
def _(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, sm_scale, causal=False,
      is_fp8_kvcache=False, backend="auto"):  # fmt: skip
    b, s_q, h_q, _ = q.shape
    return q.new_empty((b, s_q, h_q, D_V)), q.new_empty((b, h_q, s_q), dtype=torch.float32)


def call_dense_decode_op(p: DecodeProblem, plan: DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.sparse_mla.dense_decode`` on a validated dense problem and its plan."""
    return torch.ops.sparse_mla.dense_decode(
        p.q,
        p.k_cache,
        p.block_table,
        p.topk_length,
        plan.table.metadata,
        p.sm_scale,
        causal=p.causal,
        is_fp8_kvcache=p.fp8_cache,
        backend=plan.backend.name,
    )


def traced_dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tile_scheduler_metadata: FlashMLASchedMeta,
    sm_scale: float,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense decode as ``torch.compile`` traces it: straight to the custom op, with the plan of
    :func:`check_traced_plan` (its partition count and backend)."""
    plan = check_traced_plan(
        q, None, tile_scheduler_metadata, cache_seqlens, backend=backend,
        dense_topk=block_table.shape[1] * k_cache.shape[1],
    )  # fmt: skip
    return torch.ops.sparse_mla.dense_decode(
        q, k_cache, block_table, cache_seqlens, plan.table.metadata, sm_scale, causal=causal,
        is_fp8_kvcache=is_fp8_kvcache, backend=plan.backend.name,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# sparse_mla::combine


def _check_combine(o_accum, lse_accum, num_splits, out, lse, attn_sink) -> None:
    for name, t, dtypes, dim in (
        ("o_accum", o_accum, (torch.float32,), 4),
        ("lse_accum", lse_accum, (torch.float32,), 3),
        ("num_splits", num_splits, (torch.int32,), 1),
        ("out", out, (torch.bfloat16, torch.float32), 4),
        ("lse", lse, (torch.float32,), 3),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
            raise TypeError(f"{name}: expected a tensor of dtype {' or '.join(map(str, dtypes))}")
        if t.dim() != dim:
            raise ValueError(f"{name}: expected a {dim}-D tensor, got shape {list(t.shape)}")
        if t.device != out.device:
            raise ValueError(f"{name}: expected a tensor on {out.device} (where out is), got {t.device}")
        check_plain_storage(t, name)  # the kernel reads (and writes) the raw bits, inside the storage
    check_no_self_overlap(out, "out")
    check_no_self_overlap(lse, "lse")
    b, s_q, h_q, d_v = out.shape
    rows = o_accum.shape[0]
    if tuple(o_accum.shape[1:]) != (s_q, h_q, d_v):
        raise ValueError(f"o_accum: expected shape [rows, {s_q}, {h_q}, {d_v}], got {list(o_accum.shape)}")
    if tuple(lse_accum.shape) != (rows, s_q, h_q):
        raise ValueError(f"lse_accum: expected shape [{rows}, {s_q}, {h_q}], got {list(lse_accum.shape)}")
    if tuple(num_splits.shape) != (b + 1,):
        raise ValueError(f"num_splits: expected shape [{b + 1}], got {list(num_splits.shape)}")
    if tuple(lse.shape) != (b, h_q, s_q):
        raise ValueError(f"lse: expected shape [{b}, {h_q}, {s_q}], got {list(lse.shape)}")
    if o_accum.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("o_accum / out: the last dimension must be contiguous")
    if attn_sink is not None:
        if (
            not isinstance(attn_sink, torch.Tensor)
            or attn_sink.dtype != torch.float32
            or tuple(attn_sink.shape) != (h_q,)
        ):
            raise ValueError(f"attn_sink: expected a float32 tensor of shape [{h_q}]")
        if attn_sink.device != out.device:
            raise ValueError(f"attn_sink: expected a tensor on {out.device}")
        check_plain_storage(attn_sink, "attn_sink")
    # out and lse are written while the inputs are read: apart from them and from each other
    call = (o_accum, lse_accum, num_splits, attn_sink, None, None, None, None, out, lse)
    check_outputs_apart(call, relative_byte_ranges(call))
    if out.device.type == "cpu" and num_splits.numel():
        ns = num_splits.tolist()
        if ns[0] != 0 or any(ns[i + 1] < ns[i] for i in range(b)) or ns[-1] > rows:
            raise ValueError(f"num_splits: expected non-decreasing prefix sums from 0 up to rows={rows}, got {ns}")


@torch.library.custom_op("sparse_mla::combine", mutates_args=("out", "lse"))
def combine(
    o_accum: torch.Tensor,
    lse_accum: torch.Tensor,
    num_splits: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_sink: Optional[torch.Tensor] = None,
) -> None:
    """Merge split-KV partial results into ``out``/``lse`` in place (``torch.ops.sparse_mla.combine``).

    Args:
        o_accum: ``[rows, s_q, h_q, d_v]`` fp32 partial outputs, each normalised by its own sum.
        lse_accum: ``[rows, s_q, h_q]`` fp32 log2-space partial LSEs (``-inf`` = no valid key).
        num_splits: ``[b + 1]`` int32 prefix sums: batch i's pieces are rows
            ``num_splits[i] .. num_splits[i+1]-1``; batches with one piece are left alone.
        out: ``[b, s_q, h_q, d_v]`` bf16 or fp32, written for split batches.
        lse: ``[b, h_q, s_q]`` fp32 natural-log LSE, written for split batches.
        attn_sink: optional ``[h_q]`` fp32 (out scaled by ``exp(lse) / (exp(lse) + exp(sink))``).

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices; on the CPU also a malformed
        ``num_splits``.
    """
    _check_combine(o_accum, lse_accum, num_splits, out, lse, attn_sink)
    if out.numel() == 0:
        return
    if use_triton(out.device):
        from .kernels.combine import combine_fwd

        combine_fwd(o_accum, lse_accum, num_splits, out, lse, attn_sink)
        return
    from .reference import combine_reference

    combine_reference(o_accum, lse_accum, num_splits, out, lse, attn_sink)


@combine.register_fake
def _(o_accum, lse_accum, num_splits, out, lse, attn_sink=None):
    return None
