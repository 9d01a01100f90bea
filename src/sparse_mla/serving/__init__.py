"""The serving path: fused quantise-and-store into the FP8 cache (:mod:`.store`), logical
positions → cache slots (:mod:`.index_convert`), their PyTorch twins (:mod:`.reference`), and the
``torch.ops.sparse_mla.*`` custom ops (:mod:`.ops`, registered on import; no Triton imported)."""

from . import ops  # noqa: F401  (registers the custom ops)
