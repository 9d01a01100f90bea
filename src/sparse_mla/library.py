"""``torch.ops.sparse_mla.*`` custom ops and their Python entry points (kept under this name for
callers of ``import sparse_mla.library``; the ops live in :mod:`sparse_mla.serving.ops` and are
registered by ``import sparse_mla``)."""

from .indexer.ops import INDEXER_OPS
from .serving.ops import OPS as SERVING_OPS
from .serving.ops import (
    abs_indices_to_kvcache_indices,
    combine,
    quantize_and_store_kv,
    schedule_tensors,
    sparse_decode,
    sparse_prefill,
)

#: every registered operator name
OPS = SERVING_OPS + INDEXER_OPS

__all__ = [
    "OPS",
    "sparse_decode",
    "schedule_tensors",
    "combine",
    "quantize_and_store_kv",
    "abs_indices_to_kvcache_indices",
    "sparse_prefill",
]
