"""The sparse decode: dispatcher (:mod:`.backends`), kernels (:mod:`.hopper`, :mod:`.portable`,
:mod:`.combine`) and their fp32 PyTorch twins (:mod:`.reference`). Importing this package
imports no Triton: kernel modules load on first launch."""

from .backends import AUTO_ORDER, BACKENDS, Backend, backend_support, get_backend, resolve_backend, run_decode

__all__ = ["Backend", "BACKENDS", "AUTO_ORDER", "get_backend", "resolve_backend", "backend_support", "run_decode"]
