"""The FP8 sparse decode (``flash_mla_with_kvcache`` with ``indices``), in the stages of every
operation: :mod:`.problem` (validation) → :mod:`.plan` and :mod:`.scheduler` (the split-KV schedule,
kept in the scheduler object) → :mod:`.backends` (``backend=``) → :mod:`.kernels` (Hopper Gluon,
portable Triton, combine) → :mod:`.reference` (fp32 PyTorch twins) → :mod:`.op` (the
``torch.library`` ops); :mod:`.eager` is the eager call path, :mod:`.workspace` the split
accumulators. Importing this package imports no Triton: kernel modules load on first launch."""

from .backends import AUTO_ORDER, BACKENDS, Backend, backend_support, get_backend, resolve_backend, run_decode

__all__ = ["Backend", "BACKENDS", "AUTO_ORDER", "get_backend", "resolve_backend", "backend_support", "run_decode"]
