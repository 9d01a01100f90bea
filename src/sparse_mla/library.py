"""``torch.ops.sparse_mla.*`` custom ops and their Python entry points, in one namespace. Each op
lives in its operation's ``op`` module (:mod:`sparse_mla.decode.op`, :mod:`sparse_mla.prefill.op`,
:mod:`sparse_mla.kvcache.op`, :mod:`sparse_mla.indexer.op`, :mod:`sparse_mla.training.op`), and ``sparse_mla::argument_error``, which
raises a traced call's argument error when its graph runs, in :mod:`sparse_mla.core.traced`;
``import sparse_mla`` registers them."""

from .core.traced import OPS as TRACED_OPS
from .decode.eager import sparse_decode
from .decode.op import OPS as DECODE_OPS
from .decode.op import combine, schedule_tensors
from .indexer.op import INDEXER_OPS
from .kvcache.op import OPS as KVCACHE_OPS
from .kvcache.op import abs_indices_to_kvcache_indices, quantize_and_store_kv
from .prefill.op import OPS as PREFILL_OPS
from .prefill.op import sparse_prefill
from .training.op import OPS as TRAINING_OPS
from .training.op import sparse_prefill_backward

#: every registered operator name
OPS = DECODE_OPS + KVCACHE_OPS + PREFILL_OPS + INDEXER_OPS + TRAINING_OPS + TRACED_OPS

__all__ = [
    "OPS",
    "sparse_decode",
    "schedule_tensors",
    "combine",
    "quantize_and_store_kv",
    "abs_indices_to_kvcache_indices",
    "sparse_prefill",
    "sparse_prefill_backward",
]
