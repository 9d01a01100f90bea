"""The DSA lightning indexer (DeepSeek-V3.2; DeepGEMM's Python API as the convention): the FP8 key
cache and its fused quantise-and-store (:mod:`.cache`), the multi-query logits over a contiguous
key buffer (prefill) or the paged cache (decode) (:mod:`.logits`), and the top-k that turns logits
into the decode's cache indices (:mod:`.topk`). Every kernel has its PyTorch twin in
:mod:`.reference`. Importing this package imports no Triton.
"""

from . import op as _op  # noqa: F401  (registers torch.ops.sparse_mla.* of the indexer)
from .cache import dequantize_indexer_cache, indexer_k_quant_and_cache
from .logits import fp8_mqa_logits, fp8_paged_mqa_logits, get_paged_mqa_logits_metadata
from .topk import topk_indices, topk_kvcache_indices

__all__ = [
    "indexer_k_quant_and_cache",
    "dequantize_indexer_cache",
    "fp8_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "fp8_paged_mqa_logits",
    "topk_indices",
    "topk_kvcache_indices",
]
