"""Which implementation runs an indexer call, resolved as every operation's ``backend=``
(:mod:`sparse_mla.core.backend`): ``portable`` (the Triton kernels of :mod:`.kernels`: any GPU
Triton supports, with tensor-memory copies and e4m3 tensor-core dots where the GPU has them, and
the CPU under ``TRITON_INTERPRET=1``), else ``reference`` (the PyTorch twins of :mod:`.reference`;
bit-identical results). A call's problem is the device its tensors are on; its entry points ask
:meth:`~sparse_mla.core.backend.BackendSet.runs_kernels`."""

from __future__ import annotations

from ..core.backend import Anywhere, BackendSet, TritonOnly

__all__ = ["INDEXER_BACKENDS"]

#: the indexer's backends, in the order ``backend="auto"`` tries them
INDEXER_BACKENDS = BackendSet("indexer", (TritonOnly(), Anywhere()))
