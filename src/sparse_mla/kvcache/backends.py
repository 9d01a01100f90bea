"""Which implementation runs a cache write or index conversion, resolved as every operation's
``backend=`` (:mod:`sparse_mla.core.backend`): ``portable`` (the Triton kernels of :mod:`.store`
and :mod:`.index_convert`: any GPU Triton supports, and the CPU under ``TRITON_INTERPRET=1``), else
``reference`` (the PyTorch twins of :mod:`.reference`; the same bytes). A call's problem is the
device its tensors are on."""

from __future__ import annotations

import torch

from ..core.backend import Anywhere, BackendSet, TritonOnly

__all__ = ["KVCACHE_BACKENDS", "runs_kernels"]

#: the cache writes' backends, in the order ``backend="auto"`` tries them
KVCACHE_BACKENDS = BackendSet("cache write", (TritonOnly(), Anywhere()))


def runs_kernels(device: torch.device, backend: str = "auto") -> bool:
    """Whether a call on ``device`` runs the Triton kernels (``portable``) rather than the twins.

    Raises:
        TypeError / ValueError: an unknown backend, or one that cannot serve ``device``.
    """
    return KVCACHE_BACKENDS.resolve(device, backend).name == "portable"
