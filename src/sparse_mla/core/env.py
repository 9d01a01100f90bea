"""Where the kernels run: the environment's choice between compiled and interpreted kernels
(``TRITON_INTERPRET``) and of backend (``SPARSE_MLA_BACKEND``, a debugging override of every
operation's ``backend="auto"``), the device queries, and the numeric constants the kernels share.
What a GPU can do (and ``SPARSE_MLA_TARGET``, ``SPARSE_MLA_PDL``): :mod:`sparse_mla.core.target`.

Triton decides when a kernel is *defined* (``@triton.jit`` at import of its module) whether it
will be compiled or interpreted. CPU tensors can run only interpreted kernels, CUDA tensors
either. So ``TRITON_INTERPRET=1`` must be set before the kernel modules are imported (best:
before Python starts); :func:`require_runnable` turns the mismatch into a clear error instead of
Triton's "0 active drivers".
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

__all__ = [
    "interpreting",
    "use_triton",
    "require_runnable",
    "backend_override",
    "cuda_num_sms",
    "on_tensor_device",
    "LOG2E",
    "LN2",
    "next_pow2",
    "cdiv",
]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def next_pow2(x: int) -> int:
    """``triton.next_power_of_2`` for a host int (0 for 0). Triton 3.6's is a constexpr function,
    whose wrapper costs several µs of host time a call; launch paths use this one."""
    return 1 << (int(x) - 1).bit_length() if x > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host ints, without its constexpr-function wrapper (see :func:`next_pow2`)."""
    return -(-int(a) // int(b))


def interpreting() -> bool:
    """Whether Triton's interpreter is selected (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels serve tensors on ``device``: always on CUDA, on the CPU only
    under the interpreter (else the PyTorch reference twins run)."""
    return device.type == "cuda" or interpreting()


def require_runnable(kernel: Any, device: torch.device, *helpers: Any) -> None:
    """Raise ``RuntimeError`` when ``kernel`` (and the jit ``helpers`` it calls from other modules)
    cannot run tensors on ``device``.

    A kernel module imported without ``TRITON_INTERPRET=1`` holds compiled kernels, which cannot
    take CPU tensors even if the variable is set later.
    """
    if device.type == "cuda":
        return
    import triton.language.standard as tl_standard
    from triton.runtime.interpreter import InterpretedFunction

    # Triton's own library functions are defined when triton is imported, sparse_mla's kernels when
    # their module is: both must have been defined with the interpreter on
    if not all(isinstance(f, InterpretedFunction) for f in (kernel, *helpers, tl_standard.max)):
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after Triton (or sparse_mla's kernels) had been imported; Triton reads "
            "it when a kernel is defined, so set it before Python starts (e.g. `TRITON_INTERPRET=1 python ...`), "
            "or pass CUDA tensors"
        )


def backend_override() -> str | None:
    """``SPARSE_MLA_BACKEND`` if set and not ``auto`` or empty (for debugging: it replaces a caller's
    ``backend="auto"``, never an explicit choice). Validated by the dispatcher."""
    name = os.environ.get("SPARSE_MLA_BACKEND", "")
    return None if name in ("", "auto") else name


def cuda_num_sms(device: torch.device | int | None = None) -> int:
    """SM count of a CUDA device (default: the current one), looked up once per device."""
    if isinstance(device, torch.device):
        device = device.index
    return _cuda_num_sms(torch.cuda.current_device() if device is None else device)


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def on_tensor_device(fn):
    """Run ``fn`` with the current CUDA device set to its first argument's (a tensor): Triton and
    our launchers launch on the current device, so a call whose tensors live on another GPU
    than the current one would otherwise launch there with foreign pointers. Nothing changes
    when they agree (one comparison), for CPU tensors, or under ``torch.compile``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = args[0] if args else None
        if (
            type(t) is torch.Tensor
            and t.is_cuda
            and not torch.compiler.is_compiling()
            and t.device.index != torch.cuda.current_device()
        ):
            with torch.cuda.device(t.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper
