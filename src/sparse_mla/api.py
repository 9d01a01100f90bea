"""FlashMLA-compatible entry points (stage 1 of the decode path; steps 1-2 in docs/design.md).

``import sparse_mla as flash_mla`` works for callers of FlashMLA 1.0's sparse FP8 decode and of
its dense MLA decode (the same call without ``indices``)::

    sched_meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, k_cache, None, None, head_dim_v=512, tile_scheduler_metadata=sched_meta,
        is_fp8_kvcache=True, indices=indices)
    out, lse = flash_mla.flash_mla_with_kvcache(  # dense: every context position
        q, k_cache, block_table, cache_seqlens, head_dim_v=512, tile_scheduler_metadata=sched_meta2)

The call flows API → :mod:`~sparse_mla.decode.problem` (validated, frozen) → :mod:`~sparse_mla.decode.plan`
(backend + schedule, kept in ``sched_meta``) → :mod:`~sparse_mla.decode` (kernel launch,
combine) → ``(out, lse)``.
"""

from __future__ import annotations

import torch

from .core.env import on_tensor_device
from .core.traced import defer_argument_error
from .decode.eager import decode
from .decode.plan import FlashMLASchedMeta, check_sched_meta, decode_workspace_bytes, get_mla_metadata
from .decode.problem import decode_output_specs, refuse_sparse_extras
from .prefill.backends import run_prefill
from .prefill.problem import FP8_CACHE_DTYPES, check_traced_prefill_args, prefill_output_specs, validate_sparse_prefill
from .training import op as training_op  # noqa: F401  (the prefill's autograd formula)
from .training.problem import refuse_fp8_gradients

__all__ = [
    "FlashMLASchedMeta",
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "decode_workspace_bytes",
    "flash_mla_sparse_fwd",
]


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a paged latent KV cache (FlashMLA 1.0's signature and semantics): sparse
    with ``indices`` (FP8 cache, top-k slots per query token), dense without (every position of
    each request's context, through ``block_table``).

    Args:
        q: ``[b, s_q, h_q, d_qk]`` queries; ``d_qk`` 576 (V3.2 layout) or 512 (MODEL1 layout);
            ``1 <= h_q <= 128``; last dim contiguous, other strides free. bf16; the dense decode
            with a bf16/fp16 cache also takes fp16.
        k_cache: ``[num_blocks, page_block_size, 1, bytes_per_token]`` ``float8_e4m3fn`` or
            ``uint8`` bytes; 656 B/token (V32) or 584 (MODEL1; any block stride of at least
            ``page_block_size * 584`` bytes). May be a strided view of a larger pool (its
            block stride is honoured). Dense with ``is_fp8_kvcache=False``: rows
            ``[num_blocks, page_block_size, 1, d_qk]`` of q's dtype (last dim contiguous, other
            strides free); V is their first 512 columns. Any ``page_block_size >= 1``.
        block_table: ``[b, max_blocks]`` int32 (any strides) — dense only (ignored with
            ``indices``): position ``t`` of request ``i`` is slot ``block_table[i, t //
            page_block_size] * page_block_size + t % page_block_size``; entries past a request's
            length are never read (may hold anything).
        cache_seqlens: ``[b]`` int32 context lengths, in tokens — dense only (ignored with
            ``indices``): each in ``[0, max_blocks * page_block_size]``; 0 gives out 0, lse +inf.
        head_dim_v: 512.
        tile_scheduler_metadata: the object from :func:`get_mla_metadata`; filled by the first
            call, reused while the configuration and the ``topk_length`` values stay the same.
        num_splits: must be None (FlashMLA 1.0 keeps it in ``tile_scheduler_metadata``).
        softmax_scale: default ``d_qk ** -0.5``.
        causal: must be False on the sparse path. Dense: query token ``j`` (of ``s_q``, e.g.
            speculative tokens) attends the positions below ``cache_seqlens[i] - s_q + j + 1``;
            each length must then be 0 or at least ``s_q``.
        is_fp8_kvcache: must be True on the sparse path. Dense: True reads the FP8 cache (V32 /
            MODEL1 records, q bf16), False (the default) bf16/fp16 rows.
        indices: ``[b, s_q, topk]`` int32, ``block * page_block_size + offset`` into ``k_cache``;
            ``-1`` or any value outside ``[0, num_blocks * page_block_size)`` is ignored.
        attn_sink: ``[h_q]`` fp32: out scaled by ``exp(lse) / (exp(lse) + exp(sink))`` (sparse only,
            as are the four arguments below).
        extra_k_cache: second cache (same format) attended in the same softmax.
        extra_indices_in_kvcache: ``[b, s_q, extra_topk]`` int32 into ``extra_k_cache``.
        topk_length: ``[b]`` int32: only the first ``topk_length[i]`` indices of batch i count.
        extra_topk_length: ``[b]`` int32, the same for the extra cache.
        backend: ``"auto"`` (the fastest that serves the call), ``"hopper"``, ``"portable"`` or
            ``"reference"`` (keyword only; not in FlashMLA). Fixed by the first call of a
            scheduler object; ``tile_scheduler_metadata.backend`` tells which one runs. The
            dense decode runs on ``"portable"`` (any GPU, or the CPU under ``TRITON_INTERPRET=1``)
            or ``"reference"``.
        out: optional ``[b, s_q, h_q, 512]`` buffer of q's dtype (last dim contiguous, other
            strides free) the result is written into and returned (keyword only; not in FlashMLA).
        lse: optional ``[b, h_q, s_q]`` fp32 buffer (any strides), likewise.

    Workspace: the split-KV partial results live in a buffer held by ``tile_scheduler_metadata``
    (allocated by its first call, at most :func:`sparse_mla.decode_workspace_bytes`), so an eager
    call with ``out``/``lse`` given allocates no device memory. Calls sharing a scheduler object
    must run in order on one stream (as the layers of one decode step do).

    Returns:
        ``out [b, s_q, h_q, 512]`` in q's dtype and ``lse [b, h_q, s_q]`` fp32 (natural log; +inf
        and out = 0 for a query with no valid key). ``b = 0`` or ``s_q = 0`` gives empty tensors of
        these shapes and launches nothing (the scheduler object stays as it was).

    Non-finite inputs: a valid key whose score ``q·k`` is NaN or ``+inf`` (inf/NaN in ``q``)
    makes that query head's ``out`` and ``lse`` NaN; a score of ``-inf`` gives its key weight 0.
    A NaN ``attn_sink[h]`` makes head h's ``out`` NaN (lse unchanged); the lonely-query rule
    (out 0, lse +inf) holds whatever the sink. Scores are fp32, whose range bf16 shares: a finite
    ``q`` near bf16's largest values (|q| ~ 1e38) can make ``q·k`` overflow to ``±inf`` (or NaN
    from ``inf - inf`` in the sum), and such a score follows the rules above.

    Under ``torch.compile`` the call goes straight to the custom op ``torch.ops.sparse_mla.sparse_decode``
    (dense: ``torch.ops.sparse_mla.dense_decode``; no graph break), which validates the arguments when it runs; fill the scheduler object with
    one eager call first, and the compiled calls use the backend and partitioning of that fill (with
    ``topk_length`` the schedule of each call's own lengths, made on the device). What the graph
    fixes (``q``'s dtype and shape, the Python scalars, the scheduler object) is checked while
    tracing, and a failed check raises the same exception as an eager call when the compiled
    function runs (``fullgraph=True`` included; :mod:`sparse_mla.core.traced`).

    The dense decode reads the values of ``cache_seqlens`` and of the block-table entries they
    use to check them (on a GPU one host synchronisation by a scheduler object's first call;
    none while a CUDA graph is being captured or in the custom op on a GPU, where the kernel still
    stays inside the cache: lengths clamped to the table, entries outside the cache read as no
    token). Its schedule is made on the device from ``cache_seqlens`` by every call, so one
    scheduler object serves a step whatever the lengths.

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype, shape or device, or a
            ``backend`` that cannot serve the call (the message names the argument and says why);
            dense: ``cache_seqlens`` negative or longer than the block table holds, or (causal)
            between 1 and ``s_q - 1``; a block-table entry a request uses outside
            ``[0, num_blocks)``; ``k_cache`` of another dtype than q; a sparse-only argument.
    """
    try:
        check_sched_meta(tile_scheduler_metadata)
        if num_splits is not None:
            raise ValueError("num_splits: must be None (the splits live in tile_scheduler_metadata)")
        if indices is None:  # the dense decode takes none of the sparse decode's extras
            refuse_sparse_extras(attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)
    except (TypeError, ValueError) as e:
        if not torch.compiler.is_compiling():
            raise
        return defer_argument_error(e, *decode_output_specs(q, indices, k_cache))  # raised when the graph runs
    return decode(
        q, k_cache, indices, tile_scheduler_metadata, block_table=block_table, cache_seqlens=cache_seqlens,
        head_dim_v=head_dim_v, softmax_scale=softmax_scale,
        is_fp8_kvcache=is_fp8_kvcache, causal=causal, attn_sink=attn_sink, extra_k_cache=extra_k_cache,
        extra_indices_in_kvcache=extra_indices_in_kvcache, topk_length=topk_length,
        extra_topk_length=extra_topk_length, backend=backend, out=out, lse=lse,
    )  # fmt: skip


@on_tensor_device
def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill: every query token attends its own top-k keys (FlashMLA 1.0's
    ``flash_mla_sparse_fwd`` signature and semantics).

    Beyond FlashMLA: any ``h_q`` in 1..128, any ``topk >= 1``, and ``kv`` may be the FP8 paged
    cache itself, with ``indices`` holding cache slots exactly as the decode takes them (no
    up-converted BF16 copy).

    Args:
        q: ``[s_q, h_q, d_qk]`` bf16, ``d_qk`` 576 (V3.2) or 512 (MODEL1); last dim contiguous.
        kv: ``[s_kv, 1, d_qk]`` bf16 (last dim contiguous, row stride free), or the FP8 paged
            cache ``[num_blocks, page_block_size, 1, 656 | 584]`` (``float8_e4m3fn`` or ``uint8``;
            V32 for d_qk 576, MODEL1 for 512; strided pool views as in the decode).
        indices: ``[s_q, 1, topk]`` int32: rows of ``kv`` (cache slots ``block * page_block_size +
            offset`` for the FP8 form); ``-1`` or any value outside ``[0, rows)`` is ignored.
        sm_scale: softmax scale (finite, > 0), e.g. ``d_qk ** -0.5``.
        d_v: 512 (V is the first 512 dims of each key row).
        attn_sink: ``[h_q]`` fp32: out scaled by ``exp(lse) / (exp(lse) + exp(sink))``; lse and
            max_logits unchanged.
        topk_length: ``[s_q]`` int32: query token i uses only ``indices[i, 0, :topk_length[i]]``
            (values past ``topk`` count as ``topk``, below 0 as 0). Rows past it are never read,
            so NaN there cannot reach the output.
        backend: ``"auto"``, ``"hopper"`` (the decode's Gluon kernel; sm_90 GPUs, either ``kv``
            form; what ``"auto"`` picks there), ``"portable"`` (Triton kernel; CUDA, or CPU
            under ``TRITON_INTERPRET=1``) or ``"reference"`` (fp32 PyTorch); keyword only.

    Returns:
        ``out [s_q, h_q, 512]`` bf16; ``max_logits [s_q, h_q]`` fp32, the max of ``q·k·sm_scale``
        over the valid keys; ``lse [s_q, h_q]`` fp32, natural-log logsumexp of the same scores.
        A query head with no valid key gets out 0, lse +inf, max_logits -inf. A NaN or +inf score
        on a valid key makes that head's out and lse NaN (max_logits is the max, NaN or +inf);
        scores are fp32, so a finite ``q`` near bf16's largest values can overflow to such a score.

    The call is CUDA-graph safe (no host synchronisation, no allocation but the outputs) and
    under ``torch.compile`` becomes the operator ``torch.ops.sparse_mla.sparse_prefill``; a bad
    argument raises the same exception as an eager call when the compiled function runs.

    Gradients (training): when grad mode is on and ``q``, ``kv`` or ``attn_sink`` requires grad,
    ``out`` is differentiable with respect to them (eagerly and under ``torch.compile``);
    ``max_logits`` and ``lse`` are not (marked non-differentiable). The backward
    (``torch.ops.sparse_mla.sparse_prefill_backward``) saves only ``out`` and ``lse`` and
    recomputes the probabilities from them, FlashAttention's way: ``D = rowsum(dO ∘ out)``, ``P =
    exp(q·k·sm_scale − logaddexp(lse, sink))``, ``dS = P ∘ (dO·Vᵀ − D)``; ``dq = dS·K·sm_scale``
    (``q``'s dtype), ``dkv`` the sum over every valid entry that selects a row of ``dSᵀ·q·sm_scale``
    (all ``d_qk`` columns) plus ``Pᵀ·dO`` (the first 512), accumulated in a float32 buffer (fp32
    atomics in the Triton kernel: race-free, rounding order not fixed) and returned in bf16;
    ``d attn_sink = −Σ_t sigmoid(sink − lse)·D`` (fp32). Invalid indices, entries past
    ``topk_length`` and queries with no valid key contribute nothing, and rows nobody attends get
    0 (NaN there never reaches a gradient). The backward runs on the portable Triton kernel
    (``backend`` ``"hopper"`` or ``"auto"``: the best available) or the twin (``"reference"``).
    Only bf16 ``kv`` rows take gradients: the FP8 cache form raises ``ValueError`` then.

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype, shape, stride or device (the
            message names it), a backend that cannot run the call, or ``kv`` the FP8 paged cache
            in a call that needs gradients.
    """
    if torch.compiler.is_compiling():  # one operator in the graph (its tensors validated when it runs)
        # q and the Python scalars are fixed at trace time: check them now (the operator's schema
        # would turn a bool or a 0-d tensor into a float); a failed check raises when the graph runs
        try:
            check_traced_prefill_args(q, sm_scale, d_v, backend)
            if _wants_grad(q, kv, attn_sink):
                refuse_fp8_gradients(isinstance(kv, torch.Tensor) and kv.dtype in FP8_CACHE_DTYPES)
        except (TypeError, ValueError) as e:
            return defer_argument_error(e, *prefill_output_specs(q, kv))
        return torch.ops.sparse_mla.sparse_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, backend)
    p = validate_sparse_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    if _wants_grad(q, kv, attn_sink):  # through the operator, whose autograd formula is registered
        refuse_fp8_gradients(p.kv_fp8)
        return torch.ops.sparse_mla.sparse_prefill(q, kv, indices, p.sm_scale, p.d_v, attn_sink, topk_length, backend)
    return run_prefill(p, backend)


def _wants_grad(*tensors: object) -> bool:
    """Whether grad mode is on and one of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
