"""Sparse prefill (``flash_mla_sparse_fwd``): every query token attends its own top-k keys, from a
BF16 ``kv`` buffer or straight from the FP8 paged cache (DESIGN §9).

:mod:`.problem` validates a call, :mod:`.reference` is the fp32 PyTorch twin, :mod:`.portable` the
Triton ``tl`` kernel (any GPU Triton supports; the CPU under the interpreter).
"""

from .problem import PrefillProblem, validate_sparse_prefill

__all__ = ["PrefillProblem", "validate_sparse_prefill"]
