"""Triton ``tl`` kernels of the indexer and their launchers (any GPU Triton supports; the CPU under
the interpreter), imported on first use:

* :mod:`.cache`: the key cache's fused quantise-and-store (:func:`launch_quant_store`);
* :mod:`.logits`: the multi-query logits, contiguous and paged (:func:`launch_mqa_logits`,
  :func:`launch_paged_mqa_logits`; :class:`PrefillConfig`, :class:`PagedConfig`);
* :mod:`.topk`: the top-k (:func:`launch_topk`, :class:`TopkConfig`) over its kernels in
  :mod:`.topk_bisect` (rows of up to 32K: the register and split paths) and :mod:`.topk_radix`
  (the radix select of longer rows, and what every path shares).

Twins: :mod:`sparse_mla.indexer.reference`.
"""

from .cache import launch_quant_store
from .logits import (
    PAGED_CONFIG,
    PREFILL_CONFIG,
    PagedConfig,
    PrefillConfig,
    fp8_dot_supported,
    launch_mqa_logits,
    launch_paged_mqa_logits,
    tma_supported,
)
from .topk import TOPK_CONFIG, TopkConfig, launch_topk

__all__ = [
    "launch_quant_store",
    "launch_mqa_logits",
    "launch_paged_mqa_logits",
    "launch_topk",
    "fp8_dot_supported",
    "tma_supported",
    "PrefillConfig",
    "PagedConfig",
    "TopkConfig",
    "PREFILL_CONFIG",
    "PAGED_CONFIG",
    "TOPK_CONFIG",
]
