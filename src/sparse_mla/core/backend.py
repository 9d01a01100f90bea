"""The backend protocol every operation shares, and the one way ``backend=`` is resolved.

An operation (decode, prefill, indexer, cache writes) has a few implementations of the same
contract, each a :class:`Backend`: it says whether it serves a validated problem and, if not, why
(:meth:`Backend.unsupported`, a phrase that follows "it"), and runs it (:meth:`Backend.launch`,
whose arguments are the operation's own). A :class:`BackendSet` holds an operation's backends in
the order ``backend="auto"`` tries them (fastest first) and resolves a request:

- ``"auto"``: the first backend that serves the problem; the environment variable
  ``SPARSE_MLA_BACKEND`` (read by :func:`~sparse_mla.core.env.backend_override`) replaces
  ``"auto"`` for debugging, in every operation that has a backend of that name;
- a name: that backend, or ``ValueError`` saying why it cannot serve the problem.

The names in use: ``hopper`` (Gluon kernels for sm_90), ``portable`` (Triton ``tl`` kernels: any
GPU Triton supports, and the CPU under ``TRITON_INTERPRET=1``), ``reference`` (the PyTorch twin:
anywhere). Backends import their kernel modules on first launch, so resolving imports no Triton.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .env import backend_override, interpreting, use_triton
from .target import device_target, emulated_target

__all__ = [
    "Backend",
    "BackendSet",
    "ALL_BACKEND_NAMES",
    "check_backend_override",
    "problem_device",
    "sm90_unsupported",
    "triton_unsupported",
]

#: every backend name some operation has (what ``SPARSE_MLA_BACKEND`` may name)
ALL_BACKEND_NAMES = ("hopper", "portable", "reference")
#: earlier spellings of ``SPARSE_MLA_BACKEND`` values, still accepted
_ALIASES = {"gluon": "hopper", "tl": "portable", "triton": "portable"}


def problem_device(problem: Any) -> torch.device:
    """The device a problem runs on: a ``torch.device`` itself, else its ``device`` attribute."""
    return problem if isinstance(problem, torch.device) else problem.device


def sm90_unsupported(dev: torch.device) -> str | None:
    """Why a Gluon Hopper kernel cannot run on ``dev`` (None when it can): it needs compiled
    kernels on an sm_90 GPU."""
    if dev.type != "cuda":
        return f"needs an sm_90 (Hopper) GPU, the tensors are on {dev.type}"
    if interpreting():
        return "needs compiled kernels: TRITON_INTERPRET=1 is set"
    t = device_target(dev)
    if not t.hopper:
        as_ = " as SPARSE_MLA_TARGET asks" if emulated_target() is not None else ""
        return f"needs an sm_90 (Hopper) GPU, this one runs{as_} as {t.name}"
    return None


def triton_unsupported(dev: torch.device) -> str | None:
    """Why Triton kernels cannot run tensors on ``dev`` (None when they can: CUDA, or the CPU
    under the interpreter)."""
    if not use_triton(dev):
        return "runs CPU tensors only under Triton's interpreter (set TRITON_INTERPRET=1 before Python starts)"
    return None


class Backend:
    """One implementation of an operation. Subclasses set :attr:`name` and define
    :meth:`unsupported` and :meth:`launch`."""

    name: str = ""

    def unsupported(self, problem: Any) -> str | None:
        """None when this backend serves ``problem``, else why not, as a phrase that follows "it"."""
        raise NotImplementedError

    def launch(self, problem: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a validated problem this backend serves (arguments and results: the operation's)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<sparse_mla backend {self.name!r}>"


class HopperOnly(Backend):
    """A backend of Gluon sm_90 kernels: serves problems on a Hopper GPU."""

    name = "hopper"

    def unsupported(self, problem: Any) -> str | None:
        return sm90_unsupported(problem_device(problem))


class TritonOnly(Backend):
    """A backend of Triton ``tl`` kernels: serves problems wherever Triton runs their tensors."""

    name = "portable"

    def unsupported(self, problem: Any) -> str | None:
        return triton_unsupported(problem_device(problem))


class Anywhere(Backend):
    """The PyTorch twin: serves every problem."""

    name = "reference"

    def unsupported(self, problem: Any) -> str | None:
        return None


class BackendSet:
    """An operation's backends, in the order ``backend="auto"`` tries them."""

    def __init__(self, operation: str, backends: Sequence[Backend]) -> None:
        self.operation = operation
        self.by_name = {b.name: b for b in backends}
        self.auto_order = tuple(b.name for b in backends)

    def get(self, name: Any, source: str = "backend") -> Backend:
        """The backend called ``name`` (an alias such as ``"triton"`` allowed).

        Raises:
            TypeError / ValueError: not a string, or no such backend (naming ``source``).
        """
        if not isinstance(name, str):
            raise TypeError(f"{source}: expected a str, got {type(name).__name__}")
        key = _ALIASES.get(name, name)
        if key not in self.by_name:
            raise ValueError(f"{source}: expected 'auto' or one of {sorted(self.by_name)}, got {name!r}")
        return self.by_name[key]

    def support(self, problem: Any) -> dict[str, str | None]:
        """For each backend: None if it serves ``problem``, else why not."""
        return {name: self.by_name[name].unsupported(problem) for name in self.auto_order}

    def resolve(self, problem: Any, backend: Any = "auto") -> Backend:
        """The backend that runs ``problem``: the requested one, or for ``"auto"`` the first that
        serves it (``SPARSE_MLA_BACKEND``, when set to a backend of this operation, replaces ``"auto"``).

        Raises:
            TypeError / ValueError: not a string, an unknown name, or the requested backend cannot
                serve ``problem`` (the message says why).
        """
        source = "backend"
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
        emulated_target()  # a bad SPARSE_MLA_TARGET is an error on every device, CPUs included
        if backend == "auto":
            override = backend_override()
            if override is not None:
                check_backend_override()
                if _ALIASES.get(override, override) in self.by_name:
                    backend, source = override, "SPARSE_MLA_BACKEND"
        if backend == "auto":
            for name in self.auto_order:
                b = self.by_name[name]
                if b.unsupported(problem) is None:
                    return b
            raise ValueError(f"backend: no backend of the {self.operation} serves this call")  # pragma: no cover
        b = self.get(backend, source)
        reason = b.unsupported(problem)
        if reason is not None:
            raise ValueError(f"{source}: the {b.name!r} backend cannot serve this call: it {reason}")
        return b

    def runs_kernels(self, problem: Any, backend: Any = "auto") -> bool:
        """Whether :meth:`resolve` picks a kernel backend for ``problem`` rather than the PyTorch
        twin (``reference``): what an operation whose entry points launch their kernels themselves
        (the indexer, the cache writes) asks.

        Raises:
            TypeError / ValueError: as :meth:`resolve`.
        """
        return self.resolve(problem, backend).name != "reference"


def check_backend_override() -> None:
    """Check ``SPARSE_MLA_BACKEND`` up front (the CLI does, whichever path a command takes).

    Raises:
        ValueError: it is set to a name that is neither ``auto`` nor a backend.
    """
    name = backend_override()
    if name is not None and _ALIASES.get(name, name) not in ALL_BACKEND_NAMES:
        raise ValueError(f"SPARSE_MLA_BACKEND: expected 'auto' or one of {sorted(ALL_BACKEND_NAMES)}, got {name!r}")
