"""Which implementation runs a cache write or index conversion, resolved as every operation's
``backend=`` (:mod:`sparse_mla.core.backend`): ``portable`` (the Triton kernels of :mod:`.kernels`,
quantise-and-store and index conversion: any GPU Triton supports, and the CPU under
``TRITON_INTERPRET=1``), else ``reference`` (the PyTorch twins of :mod:`.reference`; the same
bytes). A call's problem is the device its tensors are on; its entry points ask
:meth:`~sparse_mla.core.backend.BackendSet.runs_kernels`."""

from __future__ import annotations

from ..core.backend import Anywhere, BackendSet, TritonOnly

__all__ = ["KVCACHE_BACKENDS"]

#: the cache writes' backends, in the order ``backend="auto"`` tries them
KVCACHE_BACKENDS = BackendSet("cache write", (TritonOnly(), Anywhere()))
