"""The decode path's kernel launches stubbed at Triton's compiled launcher, for host-time
measurement and tests on a machine without a GPU (``benchmarks/host.py``, ``tests/decode/test_host_path.py``; not part of the installed package).

Inside :func:`stub_compiled_launches` the launcher believes it runs compiled kernels on device 0:
the direct path is on even under the interpreter, a kernel's first launch returns a stub handle
instead of compiling (nothing runs), and every launch is recorded as
``(kernel name, grid, arguments)``, the arguments as the compiled launcher would get them
(runtime arguments, then the constexpr values in parameter order; tensors as data pointers).
Everything before Triton's launcher runs as it would on a GPU, so its host time can be measured.
The Hopper backend is offered for CPU tensors (``backend="hopper"``); the portable backend takes
its compiled-kernel branches. The combine's launch wrapper still needs ``TRITON_INTERPRET=1`` (or
CUDA tensors) to accept its arguments.

Kernel handles and launch recipes made inside must not be used outside: the launcher's caches are
restored on exit; scheduler objects used inside should be dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from sparse_mla.core import launcher
from sparse_mla.decode import backends
from sparse_mla.decode.kernels import combine, hopper, portable, schedule
from sparse_mla.tools.targets import Patches as _Patches

__all__ = ["stub_compiled_launches", "KERNELS"]

#: the decode path's kernels
KERNELS = (
    hopper._sparse_decode_gluon_kernel,
    portable._sparse_decode_kernel,
    combine._combine_kernel,
    schedule._schedule_kernel,
)


def _plain(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.data_ptr()
    if isinstance(a, tuple):
        return tuple(_plain(x) for x in a)
    return a


class _StubCompiled:
    """Stands for a compiled kernel: its launcher records instead of launching."""

    def __init__(self, name: str, log: list, record: bool) -> None:
        self.function = name
        self.packed_metadata = None
        self._log = log
        self._record = record

    def run(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args):
        self._log.append((function, (gx, gy, gz), _plain(args)) if self._record else function)


@contextlib.contextmanager
def stub_compiled_launches(record: bool = True) -> Iterator[list]:
    """Stub the compiled launches of the decode kernels; yields the list of launches, each
    ``(kernel name, grid, arguments)``, or only the kernel name when not ``record`` (for timing:
    the arguments' conversion is not counted)."""
    log: list = []
    mp = _Patches()
    try:
        for k in KERNELS:
            stub = _StubCompiled(k.fn.__name__, log, record)

            def first_launch(*args, grid, warmup, _k=k, _stub=stub, **kwargs):
                if warmup:  # compiled, not launched (launcher.launch's prepare hook)
                    return _stub
                names = _k.arg_names[len(args) :]
                log.append((_stub.function, tuple(grid), _plain(args + tuple(kwargs[n] for n in names))))
                return _stub

            mp.setattr(k, "run", first_launch)
        for mod in (launcher, portable):  # the compiled-kernel branches (bf16 out, direct path on)
            mp.setattr(mod, "interpreting", lambda: False)
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(launcher, "_current_stream", lambda dev: 0)
        # the stub stands in for the compiled launcher whose calling convention the version gate guards
        mp.setattr(launcher, "_triton_tested", lambda: True)
        mp.setattr(backends.HopperBackend, "unsupported", lambda self, p: None)
        mp.setattr(launcher, "_CACHE", {})
        mp.setattr(launcher, "_STAGE_CAP", {})
        yield log
    finally:
        mp.undo()
