"""``torch.ops.sparse_mla.sparse_prefill``: the sparse prefill as a ``torch.library`` custom op (with
its fake implementation, for ``torch.compile``). Registered by ``import sparse_mla``; imports no Triton."""

from __future__ import annotations

from typing import Optional

import torch

from .backends import run_prefill
from .problem import validate_sparse_prefill

__all__ = ["sparse_prefill", "OPS"]

#: the registered operator names
OPS = ("sparse_mla::sparse_prefill",)

D_V = 512


@torch.library.custom_op("sparse_mla::sparse_prefill", mutates_args=())
def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = D_V,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sparse_mla.flash_mla_sparse_fwd` as an operator: ``(out, max_logits, lse)``."""
    return run_prefill(validate_sparse_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length), backend)


@sparse_prefill.register_fake
def _(q, kv, indices, sm_scale, d_v=D_V, attn_sink=None, topk_length=None, backend="auto"):
    if q.dim() != 3:
        raise ValueError(f"q: expected a 3-D tensor [s_q, h_q, d_qk], got shape {list(q.shape)}")
    s_q, h_q, _ = q.shape
    return (
        q.new_empty((s_q, h_q, d_v), dtype=torch.bfloat16),
        q.new_empty((s_q, h_q), dtype=torch.float32),
        q.new_empty((s_q, h_q), dtype=torch.float32),
    )
