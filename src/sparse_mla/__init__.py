"""sparse_mla: DeepSeek Sparse Attention for MLA in Triton with FlashMLA's API: the FP8 sparse decode,
the sparse prefill and the lightning indexer.

``import sparse_mla as flash_mla`` is a drop-in for FlashMLA 1.0's sparse FP8 decode and dense MLA
decode (``get_mla_metadata``, ``flash_mla_with_kvcache``) and sparse prefill (``flash_mla_sparse_fwd``);
the indexer calls (``indexer_k_quant_and_cache``, ``fp8_mqa_logits``, ``fp8_paged_mqa_logits``,
``topk_indices``, ``topk_kvcache_indices``) follow DeepGEMM's.

Importing the package registers the ``torch.ops.sparse_mla.*`` custom ops (for ``torch.compile``)
and imports no Triton: the kernel modules load on first use, so ``TRITON_INTERPRET`` can still be
set after ``import sparse_mla`` (before the first kernel call).

Layout (docs/architecture.md): one package per operation, each with the same stages —
``problem`` (validation) → ``backends`` (``backend=`` resolution) → ``kernels`` → ``reference``
(the PyTorch twin) → ``op`` (``torch.library``): :mod:`.decode`, :mod:`.prefill`, :mod:`.indexer`,
:mod:`.kvcache` (cache writes), :mod:`.training` (the prefill's backward, the indexer's loss). Beneath them :mod:`.core` (environment, checks, backend protocol,
launcher, FP8 and paging helpers) and :mod:`.formats` (cache layouts); above them :mod:`.api`
(FlashMLA's entry points), :mod:`.distributed`, :mod:`.tools` (CLI) and :mod:`.testing`.
"""

from .api import (
    FlashMLASchedMeta,
    decode_workspace_bytes,
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    get_mla_metadata,
)
from .decode import op as _decode_op  # noqa: F401  (registers torch.ops.sparse_mla.*)
from .formats import MODEL1, V32, KVCacheLayout, dequantize_k_cache, get_layout, quantize_k_cache
from .indexer import (
    dequantize_indexer_cache,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    get_paged_mqa_logits_metadata,
    indexer_k_quant_and_cache,
    topk_indices,
    topk_kvcache_indices,
)
from .kvcache import op as _kvcache_op  # noqa: F401
from .kvcache.index_convert import abs_indices_to_kvcache_indices_triton
from .kvcache.reference import abs_indices_to_kvcache_indices
from .kvcache.store import quantize_and_store_kv
from .prefill import op as _prefill_op  # noqa: F401
from .training import indexer_kl_loss

__version__ = "0.1.0"

__all__ = [
    "FlashMLASchedMeta",
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd",
    "decode_workspace_bytes",
    "KVCacheLayout",
    "V32",
    "MODEL1",
    "get_layout",
    "quantize_k_cache",
    "dequantize_k_cache",
    "abs_indices_to_kvcache_indices",
    "indexer_k_quant_and_cache",
    "dequantize_indexer_cache",
    "fp8_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "fp8_paged_mqa_logits",
    "topk_indices",
    "topk_kvcache_indices",
    "quantize_and_store_kv",
    "abs_indices_to_kvcache_indices_triton",
    "indexer_kl_loss",
]
