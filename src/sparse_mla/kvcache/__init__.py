"""Writing the FP8 paged cache: the fused quantise-and-store of new tokens' latent rows
(:mod:`.store`) and the conversion of logical top-k positions into cache indices through a block
table (:mod:`.index_convert`); argument checks in :mod:`.problem`, the PyTorch twins in
:mod:`.reference`, the ``torch.ops.sparse_mla.*`` ops in :mod:`.op`. Importing this package imports
no Triton: the kernel modules load on first use."""

from .reference import abs_indices_to_kvcache_indices

__all__ = ["abs_indices_to_kvcache_indices"]
