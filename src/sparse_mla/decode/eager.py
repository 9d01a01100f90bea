"""The eager sparse decode: validate, plan on first use, launch; and the repeated-call shortcut.

:func:`decode` is what :func:`sparse_mla.flash_mla_with_kvcache` runs (and
:func:`sparse_decode`, the same call through the ``torch.ops.sparse_mla.sparse_decode`` operator).
A scheduler object remembers its last validated call in a :class:`CallCache`: a later call with the
same geometry (dtypes, shapes, strides, devices, alignment and scalars: its *fingerprint*) skips
validation and planning, and, once the first call's launches were recorded, replays them with the
new tensors (:class:`~sparse_mla.core.launcher.Replay`). Under ``torch.compile`` the call goes
straight to the operator (:func:`~sparse_mla.decode.op.traced_sparse_decode`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..core.env import on_tensor_device, use_triton
from ..core.traced import defer_argument_error
from .backends import resolve_backend, run_decode
from .op import (
    D_V,
    call_dense_decode_op,
    call_sparse_decode_op,
    check_traced_plan,
    traced_dense_decode,
    traced_sparse_decode,
)
from .plan import DecodePlan, FlashMLASchedMeta, check_sched_meta, ensure_plan
from .problem import (
    DecodeProblem,
    check_dense_values,
    check_outputs_apart,
    check_traced_decode_args,
    check_traced_dense_args,
    decode_output_specs,
    empty_outputs,
    into_buffers,
    is_empty,
    relative_byte_ranges,
    validate_dense_decode,
    validate_sparse_decode,
)

if TYPE_CHECKING:  # importing the launcher imports Triton
    from ..core.launcher import Replay

__all__ = ["decode", "sparse_decode", "CallCache", "dense_or_none"]


@dataclasses.dataclass
class CallCache:
    """What a scheduler object remembers of its last validated eager call (never the call's
    tensors: the object must not keep them alive).

    Attributes:
        fingerprint: :func:`_fingerprint` of the call's tensors.
        scalars: the scalar arguments with their types (``512.0 == 512``, but validation refuses a
            float ``head_dim_v``).
        problem: the validated :class:`~sparse_mla.decode.problem.DecodeProblem` with its tensor
            fields set to None (a repeated call puts its own in).
        replay: the recorded launches (:class:`~sparse_mla.core.launcher.Replay`); None before the
            first launch recorded them, False when they cannot be replayed (not tried again).
        out_spans: the tensors' relative byte ranges when the caller gave ``out`` or ``lse`` (for
            their overlap rule), else None.
        ranges: the tensors' relative byte ranges (a repeated call's storage bounds).
        plan: the plan the call ran with (a plan set by hand since invalidates the entry).
    """

    fingerprint: tuple
    scalars: tuple
    problem: DecodeProblem
    replay: Replay | None | bool
    out_spans: tuple | None
    ranges: tuple
    plan: DecodePlan


@on_tensor_device
def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor | None,
    tile_scheduler_metadata: FlashMLASchedMeta,
    *,
    block_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    head_dim_v: int = D_V,
    softmax_scale: float | None = None,
    is_fp8_kvcache: bool = True,
    causal: bool = False,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    backend: str = "auto",
    through_op: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode behind :func:`sparse_mla.flash_mla_with_kvcache` and :func:`sparse_decode`:
    validate, plan (first call), launch with the plan's workspace. Sparse with ``indices``; dense
    (``block_table``, ``cache_seqlens``) without. Compiled, it goes straight to the op
    (:func:`traced_sparse_decode`, :func:`traced_dense_decode`); eager, through the op only when
    ``through_op``. The op allocates its outputs: a caller's ``out``/``lse`` then get a copy."""
    dense = indices is None
    if dense and torch.compiler.is_compiling():
        return _traced_dense(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, head_dim_v,
                             softmax_scale, is_fp8_kvcache, causal, backend, out, lse)  # fmt: skip
    if torch.compiler.is_compiling():
        try:  # what the graph fixes is checked now; a failed check raises when the graph runs
            sm_scale = check_traced_decode_args(q, indices, head_dim_v, softmax_scale, is_fp8_kvcache, causal, out, lse)
            check_traced_plan(q, indices, tile_scheduler_metadata, topk_length, extra_indices_in_kvcache,
                              extra_topk_length, backend)  # fmt: skip
        except (TypeError, ValueError) as e:
            return defer_argument_error(e, *decode_output_specs(q, indices, k_cache))
        return into_buffers(out, lse, *traced_sparse_decode(
            q, k_cache, indices, tile_scheduler_metadata, sm_scale, topk_length, attn_sink, extra_k_cache,
            extra_indices_in_kvcache, extra_topk_length, backend,
        ))  # fmt: skip
    check_sched_meta(tile_scheduler_metadata)
    # the call's tensors by DecodeProblem field: what the fingerprint covers and a repeated call replaces
    # (dense: the block table in the place of the indices, cache_seqlens in that of topk_length)
    rows = dict(block_table=block_table) if dense else dict(indices=indices)
    fields = dict(q=q, k_cache=k_cache, **rows, topk_length=cache_seqlens if dense else topk_length,
                  attn_sink=attn_sink, extra_k_cache=extra_k_cache, extra_indices=extra_indices_in_kvcache,
                  extra_topk_length=extra_topk_length, out=out, lse=lse)  # fmt: skip
    # with their types: 512.0 == 512 and True == 1, but validation refuses a float head_dim_v / bool scale
    scalars = (head_dim_v, type(head_dim_v), softmax_scale, type(softmax_scale), is_fp8_kvcache,
               type(is_fp8_kvcache), causal, type(causal), backend)  # fmt: skip
    vals = tuple(fields.values())
    fp = None if through_op else _fingerprint(vals)
    cached = tile_scheduler_metadata.call_cache
    if (
        fp is not None
        and cached is not None
        and cached.fingerprint == fp
        and cached.scalars == scalars
        and cached.plan is tile_scheduler_metadata.plan  # (not a plan set by hand since)
        and _inside_storage(vals, cached.ranges)
    ):
        # the same geometry as the last validated call of this object: only the data differ. The
        # caller's out/lse must still not overlap this call's inputs (addresses are not in fp)
        if cached.out_spans is not None:
            check_outputs_apart(tuple(fields.values()), cached.out_spans)
        for name in _VECTOR_FIELDS:
            fields[name] = dense_or_none(fields[name])
        if dense and q.device.type == "cpu":  # the lengths' values, where reading them costs no sync
            check_dense_values(dataclasses.replace(cached.problem, **fields))
        if cached.replay:
            done = _replay(cached.replay, q, fields)
            if done is not None:
                return done
        p = dataclasses.replace(cached.problem, **fields)
        return _launch_planned(p, tile_scheduler_metadata.plan, tile_scheduler_metadata, fields)
    validate = validate_dense_decode if dense else validate_sparse_decode
    where = dict(block_table=block_table, cache_seqlens=cache_seqlens) if dense else dict(indices=indices)
    p = validate(
        q=q, k_cache=k_cache, **where, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
        is_fp8_kvcache=is_fp8_kvcache, causal=causal, attn_sink=attn_sink, extra_k_cache=extra_k_cache,
        extra_indices_in_kvcache=extra_indices_in_kvcache, topk_length=topk_length,
        extra_topk_length=extra_topk_length, out=out, lse=lse,
    )  # fmt: skip
    if is_empty(p):
        resolve_backend(p, backend)  # checked on an empty step too (no plan is made for it)
        return empty_outputs(p)
    plan = ensure_plan(tile_scheduler_metadata, p, backend)
    if through_op:
        if dense:
            return into_buffers(out, lse, *call_dense_decode_op(p, plan), q.dtype)
        return into_buffers(out, lse, *call_sparse_decode_op(p, plan))
    # the shortcut compares the scalars with ==: kept only for the built-in types, whose == cannot
    # lie (the types are compared too, so a later call with another type is validated)
    if fp is None or not all(type(x) in _PLAIN_SCALARS for x in scalars[0::2]):
        tile_scheduler_metadata.call_cache = None
        return _launch_planned(p, plan)
    # kept without the call's tensors (the object must not keep them alive); the launch replay is
    # made by the first launch
    stripped = dataclasses.replace(p, **dict.fromkeys(fields))
    ranges = relative_byte_ranges(vals)
    spans = ranges if out is not None or lse is not None else None
    tile_scheduler_metadata.call_cache = CallCache(fp, scalars, stripped, None, spans, ranges, plan)
    fields.update(topk_length=p.topk_length, attn_sink=p.attn_sink, extra_topk_length=p.extra_topk_length)
    return _launch_planned(p, plan, tile_scheduler_metadata, fields)


def _traced_dense(
    q, k_cache, block_table, cache_seqlens, meta, head_dim_v, softmax_scale, is_fp8_kvcache, causal, backend, out, lse
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense decode under ``torch.compile``: what the graph fixes is checked now (a failed check
    raises when the graph runs), then straight to ``torch.ops.sparse_mla.dense_decode``."""
    try:
        sm_scale = check_traced_dense_args(q, k_cache, block_table, head_dim_v, softmax_scale, is_fp8_kvcache, causal,
                                           out, lse)  # fmt: skip
        check_traced_plan(q, None, meta, cache_seqlens, backend=backend,
                          dense_topk=block_table.shape[1] * k_cache.shape[1])  # fmt: skip
    except (TypeError, ValueError) as e:
        return defer_argument_error(e, *decode_output_specs(q, None, k_cache))
    done = traced_dense_decode(q, k_cache, block_table, cache_seqlens, meta, sm_scale, causal, is_fp8_kvcache, backend)
    return into_buffers(out, lse, *done, q.dtype)


def _launch_planned(
    p: DecodeProblem, plan: DecodePlan, meta: FlashMLASchedMeta | None = None, fields: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch a validated, non-empty problem with its plan. A call being captured in a CUDA graph
    takes its workspace (and a schedule made from lengths) from the graph's pool (the graph then
    outlives the scheduler object); eager calls reuse the plan's.

    With ``meta`` (whose ``call_cache`` describes ``p``) and the call's tensors by field
    (``fields``, the 1-D ones as ``p`` has them), an eager call whose cache entry has no replay
    yet records its launches and keeps their :class:`~sparse_mla.core.launcher.Replay` there
    (False when they cannot be replayed, e.g. the reference backend's: not tried again)."""
    capturing = p.q.is_cuda and torch.cuda.is_current_stream_capturing()
    workspace = None if capturing else plan.workspace
    entry = None if meta is None else meta.call_cache
    if capturing or entry is None or entry.replay is not None or not use_triton(p.q.device):
        return run_decode(p, plan.backend, plan.table, workspace=workspace, own_table=not capturing)
    from ..core import launcher

    with launcher.recording() as launches:
        out, lse = run_decode(p, plan.backend, plan.table, workspace=workspace, own_table=True)
    replay = _make_replay(launches, plan, fields, out, lse)
    # a launch recorded as None (a launch hook, the direct path off) may be replayable next time
    if replay is not None or None not in launches:
        entry.replay = replay or False
    return out, lse


def _make_replay(launches: list, plan: DecodePlan, fields: dict, out: torch.Tensor, lse: torch.Tensor) -> Replay | None:
    """The :class:`~sparse_mla.core.launcher.Replay` of a decode call's launches: per-call
    tensors are the call's (``fields``) with ``out``/``lse`` the buffers written, allocated anew
    per call by :func:`_replay` when the caller gave none; the plan's schedule and workspace stay."""
    from ..core import launcher

    b, s_q, h_q, _ = fields["q"].shape
    for given, buf, dtype, shape in (
        (fields["out"], out, fields["q"].dtype, (b, s_q, h_q, D_V)),
        (fields["lse"], lse, torch.float32, (b, h_q, s_q)),
    ):
        if given is not None and buf is not given:
            return None
        if given is None and (buf.dtype != dtype or buf.shape != shape or not buf.is_contiguous()):
            return None  # not what _replay allocates
    t = plan.table
    fixed = (t.metadata, t.num_splits, t.acc_rows, t.main_blocks, t.num_blocks_t, *plan.workspace)
    if t.split_list is not None:
        fixed += (t.split_list,)
    return launcher.make_replay(launches, _call_tensors(fields, out, lse), fixed)


def _call_tensors(fields: dict, out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """The per-call tensors of a replay, in its order (dense: the block table in the place of the indices)."""
    rows = fields["indices"] if "indices" in fields else fields["block_table"]
    return (fields["q"], fields["k_cache"], rows, fields["topk_length"], fields["attn_sink"],
            fields["extra_k_cache"], fields["extra_indices"], fields["extra_topk_length"], out, lse)  # fmt: skip


def _replay(replay: Replay, q: torch.Tensor, fields: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Relaunch a call's recorded launches with this call's tensors (``fields``, same fingerprint
    and scalars as the recording call): ``(out, lse)``, or None (nothing launched) when the
    replay's checks fail or the call is being captured in a CUDA graph (its workspace differs)."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    out, lse = fields["out"], fields["lse"]
    b, s_q, h_q, _ = q.shape
    # (the sizes one by one: torch.empty parses them faster than a shape tuple)
    if out is None:
        out = torch.empty(b, s_q, h_q, D_V, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    return (out, lse) if replay.run(_call_tensors(fields, out, lse)) else None


#: the 1-D arguments the validator returns contiguous
_VECTOR_FIELDS = ("topk_length", "attn_sink", "extra_topk_length")


def _fingerprint(tensors) -> tuple | None:
    """What validation depends on in the tensor arguments (dtype, shape, strides, device, 16-byte
    alignment), or None when one is neither a plain tensor nor None (no shortcut). Not the storage
    offset: the layers of an engine are often views of one pool at different offsets, and one
    scheduler object serves them all (a fingerprint per offset re-validated every layer's call)."""
    tensors = tuple(tensors)
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            return None
    # a sparse tensor raises here (validation then names it); a zero tensor has data pointer 0
    try:
        return tuple(
            [
                None
                if t is None
                else (t.dtype, t.shape, t.stride(), t.device, (ptr := t.data_ptr()) & 15, ptr == 0, t.is_neg())
                for t in tensors
            ]
        )
    except RuntimeError:
        return None


def _inside_storage(tensors: tuple, ranges: tuple) -> bool:
    """Whether each tensor's elements still lie inside its storage at its offset (``ranges``:
    :func:`~sparse_mla.decode.problem.relative_byte_ranges` of the validated call with the same
    fingerprint; strides are never negative, so each range starts at the data pointer)."""
    for i, _lo, hi in ranges:
        t = tensors[i]
        if t.storage_offset() * t.element_size() + hi >= t.untyped_storage().nbytes():
            return False
    return True


#: scalar argument types the repeated-call shortcut compares (others are validated on every call)
_PLAIN_SCALARS = (int, float, bool, str, type(None))


def dense_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    """A 1-D argument as the validator returns it (contiguous; a copy for a view, on the device)."""
    return None if t is None else t.contiguous()


def sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    tile_scheduler_metadata: FlashMLASchedMeta,
    softmax_scale: float | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse path of :func:`sparse_mla.flash_mla_with_kvcache` through ``torch.ops.sparse_mla.sparse_decode``.

    Same arguments, semantics and errors as :func:`sparse_mla.flash_mla_with_kvcache` with
    ``is_fp8_kvcache=True`` and ``indices`` given (``head_dim_v`` is 512): q ``[b, s_q, h_q, d_qk]``
    bf16, k_cache ``[num_blocks, page_block_size, 1, 656 | 584]`` fp8/uint8, indices ``[b, s_q, topk]``
    int32 cache indices, optional ``topk_length [b]`` int32, ``attn_sink [h_q]`` fp32, extra cache,
    ``backend``. The scheduler object is filled on first use (one host read of ``topk_length``).

    Returns:
        ``out [b, s_q, h_q, 512]`` bf16 and ``lse [b, h_q, s_q]`` fp32 (natural log).
    """
    return decode(
        q, k_cache, indices, tile_scheduler_metadata, softmax_scale=softmax_scale, attn_sink=attn_sink,
        extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices_in_kvcache, topk_length=topk_length,
        extra_topk_length=extra_topk_length, backend=backend, through_op=True,
    )  # fmt: skip
