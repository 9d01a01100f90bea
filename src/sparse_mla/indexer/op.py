"""``torch.library`` custom ops of the indexer (registered by ``import sparse_mla``), each with a
fake implementation, so ``torch.compile(fullgraph=True)`` traces them and CUDA graphs capture them:

=====================================================  ===============================================
``sparse_mla::indexer_k_quant_and_cache``              quantise + store indexer keys (mutates ``kv_cache``)
``sparse_mla::fp8_mqa_logits``                         prefill logits (``kv`` as two tensors)
``sparse_mla::fp8_paged_mqa_logits``                   decode logits over the paged key cache
``sparse_mla::topk_indices``                           exact top-k positions per row
=====================================================  ===============================================

Each validates its arguments when it runs and calls the function of the same name in
:mod:`sparse_mla.indexer`.
"""

from __future__ import annotations

import torch

from .cache import indexer_k_quant_and_cache as _store
from .logits import fp8_mqa_logits as _mqa
from .logits import fp8_paged_mqa_logits as _paged
from .topk import topk_indices as _topk

__all__ = ["INDEXER_OPS"]

INDEXER_OPS = (
    "sparse_mla::indexer_k_quant_and_cache",
    "sparse_mla::fp8_mqa_logits",
    "sparse_mla::fp8_paged_mqa_logits",
    "sparse_mla::topk_indices",
)


@torch.library.custom_op("sparse_mla::indexer_k_quant_and_cache", mutates_args=("kv_cache",))
def _store_op(
    k: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_fmt: str | None = "ue8m0",
    backend: str = "auto",
) -> None:
    _store(k, kv_cache, slot_mapping, scale_fmt, backend=backend)


@_store_op.register_fake
def _(k, kv_cache, slot_mapping, scale_fmt="ue8m0", backend="auto"):
    return None


@torch.library.custom_op("sparse_mla::fp8_mqa_logits", mutates_args=())
def _mqa_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    return _mqa(q, (kv, kv_scale), weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, backend=backend)


def _need_dims(x: torch.Tensor, name: str, dim: int) -> None:
    """The fake implementations read shapes: a wrong rank gets the functions' named error."""
    if x.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor, got shape {list(x.shape)}")


@_mqa_op.register_fake
def _(q, kv, kv_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True, backend="auto"):
    _need_dims(q, "q", 3)
    _need_dims(kv, "kv[0]", 2)
    return q.new_empty((q.shape[0], kv.shape[0]), dtype=torch.float32)


@torch.library.custom_op("sparse_mla::fp8_paged_mqa_logits", mutates_args=())
def _paged_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    return _paged(
        q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits, backend=backend
    )


@_paged_op.register_fake
def _(
    q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits=False, backend="auto"
):
    _need_dims(q, "q", 4)
    if max_context_len < 0:
        raise ValueError(f"max_context_len: expected an int >= 0, got {max_context_len}")
    return q.new_empty((q.shape[0] * q.shape[1], max_context_len), dtype=torch.float32)


@torch.library.custom_op("sparse_mla::topk_indices", mutates_args=())
def _topk_op(
    logits: torch.Tensor,
    k: int,
    row_starts: torch.Tensor | None = None,
    row_ends: torch.Tensor | None = None,
    ordered: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    return _topk(logits, k, row_starts, row_ends, sorted=ordered, backend=backend)


@_topk_op.register_fake
def _(logits, k, row_starts=None, row_ends=None, ordered=True, backend="auto"):
    _need_dims(logits, "logits", 2)
    if k < 1:
        raise ValueError(f"k: expected an int >= 1, got {k}")
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)
