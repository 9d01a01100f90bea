"""``torch.ops.sparse_mla.*`` custom ops and their Python entry points (kept under this name for
callers of ``import sparse_mla.library``; the ops live in :mod:`sparse_mla.serving.ops` and are
registered by ``import sparse_mla``)."""

from .serving.ops import (
    OPS,
    abs_indices_to_kvcache_indices,
    combine,
    quantize_and_store_kv,
    schedule_tensors,
    sparse_decode,
    sparse_prefill,
)

__all__ = [
    "OPS",
    "sparse_decode",
    "schedule_tensors",
    "combine",
    "quantize_and_store_kv",
    "abs_indices_to_kvcache_indices",
    "sparse_prefill",
]
