"""``torch.ops.sparse_mla.sparse_prefill_backward`` (the sparse prefill's backward as a
``torch.library`` custom op, with its fake implementation) and the autograd formula of
``torch.ops.sparse_mla.sparse_prefill``, registered with ``torch.library.register_autograd``: the
prefill is differentiable eagerly and under ``torch.compile`` (AOTAutograd traces the backward op).
Registered by ``import sparse_mla``; imports no Triton."""

from __future__ import annotations

from typing import Optional

import torch

from ..prefill import op as prefill_op  # noqa: F401  (defines sparse_mla::sparse_prefill first)
from ..prefill.problem import FP8_CACHE_DTYPES
from .backends import backward_backend_name, run_prefill_backward
from .problem import refuse_fp8_gradients, validate_prefill_backward

__all__ = ["sparse_prefill_backward", "OPS"]

#: the registered operator names
OPS = ("sparse_mla::sparse_prefill_backward",)


@torch.library.custom_op("sparse_mla::sparse_prefill_backward", mutates_args=())
def sparse_prefill_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sparse prefill's gradients: ``(dq [s_q, h_q, d_qk] in q's dtype, dkv [s_kv, 1, d_qk] in
    kv's dtype, dsink [h_q] fp32)`` (``dsink`` zeros without ``attn_sink``) from the gradient
    ``dout [s_q, h_q, 512]`` of ``out`` and the forward's ``out`` and ``lse``
    (:func:`sparse_mla.training.reference.sparse_prefill_backward_reference` is its twin).

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype, shape or device, or ``kv``
            the FP8 paged cache (the message names the argument).
    """
    p = validate_prefill_backward(dout, q, kv, indices, out, lse, sm_scale, attn_sink, topk_length)
    dq, dkv, dsink = run_prefill_backward(p, backend)
    if dsink is None:
        dsink = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
    return dq.to(q.dtype), dkv.to(kv.dtype), dsink


@sparse_prefill_backward.register_fake
def _(dout, q, kv, indices, out, lse, sm_scale, attn_sink=None, topk_length=None, backend="auto"):
    return torch.empty_like(q), torch.empty_like(kv), q.new_empty((q.shape[1],), dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    q, kv, indices, sm_scale, _d_v, attn_sink, topk_length, backend = inputs
    out, max_logits, lse = output
    ctx.mark_non_differentiable(max_logits, lse)
    refuse_fp8_gradients(kv.dtype in FP8_CACHE_DTYPES)
    ctx.save_for_backward(q, kv, indices, out, lse, attn_sink, topk_length)
    ctx.sm_scale = sm_scale
    ctx.backend = backward_backend_name(backend)


def _backward(ctx, dout, _d_max_logits, _d_lse):
    q, kv, indices, out, lse, attn_sink, topk_length = ctx.saved_tensors
    dq, dkv, dsink = torch.ops.sparse_mla.sparse_prefill_backward(
        dout, q, kv, indices, out, lse, ctx.sm_scale, attn_sink, topk_length, ctx.backend
    )
    return dq, dkv, None, None, None, (dsink if attn_sink is not None else None), None, None


torch.library.register_autograd("sparse_mla::sparse_prefill", _backward, setup_context=_setup_context)
