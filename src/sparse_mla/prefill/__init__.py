"""Sparse prefill (``flash_mla_sparse_fwd``): every query token attends its own top-k keys, from a
BF16 ``kv`` buffer or straight from the FP8 paged cache.

The stages of every operation: :mod:`.problem` validates a call, :mod:`.backends` picks the
implementation (``backend=``), :mod:`.kernels` holds the Hopper (Gluon, sm_90) and portable (Triton
``tl``: any GPU Triton supports, the CPU under the interpreter) kernels, :mod:`.reference` the fp32
PyTorch twin, :mod:`.op` the ``torch.ops.sparse_mla.sparse_prefill`` custom op.
"""

from .problem import PrefillProblem, validate_sparse_prefill

__all__ = ["PrefillProblem", "validate_sparse_prefill"]
