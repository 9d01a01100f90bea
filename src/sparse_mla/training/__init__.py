"""Training support: the sparse prefill's backward and the lightning indexer's training loss.

* ``flash_mla_sparse_fwd`` is differentiable in ``q``, ``kv`` (bf16 rows) and ``attn_sink``: its
  custom op ``torch.ops.sparse_mla.sparse_prefill`` has an autograd formula (:mod:`.op`) whose
  backward is the op ``torch.ops.sparse_mla.sparse_prefill_backward``, run by :mod:`.backends`
  on the portable Triton kernels (:mod:`.kernels.backward`) or the PyTorch twin (:mod:`.reference`).
* :func:`indexer_kl_loss` (:mod:`.indexer_loss`): the KL divergence between the main attention's
  head-summed distribution and the indexer's softmax, for the dense warm-up and the sparse stage.

The stages of every operation: :mod:`.problem` validates, :mod:`.backends` picks, :mod:`.kernels`
holds the kernels, :mod:`.reference` the twins, :mod:`.op` the custom op.
"""

from .indexer_loss import indexer_kl_loss
from .problem import BackwardProblem, validate_prefill_backward

__all__ = ["indexer_kl_loss", "BackwardProblem", "validate_prefill_backward"]
