"""Argument errors of a call that ``torch.compile`` traces, raised as the library's own exceptions.

While Dynamo traces a function, a Python exception is a graph break. With ``fullgraph=True`` the
caller then gets ``torch._dynamo.exc.Unsupported`` ("Observed exception", PyTorch's hints, and
the library's ``ValueError('head_dim_v: expected 512, got 256')`` only on a "Developer debug
context" line in the middle); ``raise``, ``assert``, ``torch._check``, ``torch._check_value``
and ``torch._check_type`` all end there (torch 2.13), and an exception from an operator's fake
implementation becomes a ``TorchRuntimeError`` ("Dynamo failed to run FX node with fake tensors:
..."). None of them reaches the caller as the library raised it.

So a traced call checks what it can while tracing (the Python scalars, the shapes and dtypes the
graph fixes) and, when a check fails, puts in the graph, in place of its operation, the operator
``sparse_mla::argument_error`` (:func:`defer_argument_error`): when the graph runs -- on the call
of the compiled function, where the eager call would have raised -- it raises the same exception
type with the same message. Dynamo guards on what the check read (a dtype, a Python number), so
a later call with good arguments compiles anew. The operator's outputs stand in for the
operation's (with the shapes it would have had where they are known), so the rest of the
caller's function traces; it is kept in the graph even where they are unused. Under
``torch.export`` the exception is raised at once: an exported program must not carry it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["argument_error", "defer_argument_error", "deferred_output", "OPS"]

#: the registered operator names
OPS = ("sparse_mla::argument_error",)

#: the exception types the operator raises, by name
_EXCEPTIONS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "NotImplementedError": NotImplementedError,
}


@torch.library.custom_op("sparse_mla::argument_error", mutates_args=())
def argument_error(
    exc_type: str, message: str, shape: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Raise ``exc_type(message)`` (``"TypeError"``, ``"ValueError"`` or ``"NotImplementedError"``); a tensor of ``shape``,
    ``dtype`` and ``device`` is what it returns while traced."""
    raise _EXCEPTIONS.get(exc_type, ValueError)(message)


@argument_error.register_fake
def _(exc_type, message, shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


# its outputs may go unused (a caller that reads its own out= buffer): keep it in the graph anyway
if hasattr(torch.fx.node, "has_side_effect"):
    torch.fx.node.has_side_effect(torch.ops.sparse_mla.argument_error.default)


def _exporting() -> bool:
    """``torch.compiler.is_exporting()``, read from its flag: the callers are ``except`` blocks,
    and torch 2.11's Dynamo, calling ``is_exporting()`` there, loses the handler and reports the
    exception being handled as uncaught (``Unsupported: Observed exception``); reading the flag is
    traced as a constant."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def defer_argument_error(
    error: Exception, outputs: Sequence[tuple[Sequence[int], torch.dtype]], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """While tracing: the operation's outputs as ``sparse_mla::argument_error`` calls that raise
    ``error`` when the graph runs; under ``torch.export``, ``error`` itself.

    Args:
        error: the failed check's exception (a ``TypeError``, ``ValueError`` or
            ``NotImplementedError``; another type is raised as a ``ValueError``).
        outputs: ``(shape, dtype)`` of each output of the operation.
        device: where the outputs would be.
    """
    if _exporting():
        raise error
    exc_type = "ValueError"
    for name, cls in _EXCEPTIONS.items():
        if isinstance(error, cls):
            exc_type = name
    message = str(error)
    return tuple(
        torch.ops.sparse_mla.argument_error(exc_type, message, list(shape), dtype, device) for shape, dtype in outputs
    )


def deferred_output(
    error: Exception, like: object, shape: Sequence[int], dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """:func:`defer_argument_error` for an operation of one output of ``shape`` and ``dtype``, on
    the device of ``like`` (the call's first tensor argument; the CPU when it is not a tensor)."""
    device = like.device if isinstance(like, torch.Tensor) else torch.device("cpu")
    return defer_argument_error(error, [(shape, dtype)], device)[0]
