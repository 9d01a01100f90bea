"""What the command-line tools share: why the kernels cannot be imported, in words, and a quiet
interpreter (no NumPy floating-point warnings from masked-out lanes)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence

__all__ = ["KERNEL_MODULE", "describe_import_error", "kernel_import_error", "triton_version", "quiet_interpreter"]

#: the module whose import tells whether the decode kernels can run
KERNEL_MODULE = "sparse_mla.decode.kernels.portable"


def describe_import_error(e: ImportError) -> str:
    """The real cause of a failed kernel import, in words (``numpy is not installed ...``)."""
    root = (getattr(e, "name", None) or "").split(".")[0]
    if isinstance(e, ModuleNotFoundError) and root == "numpy":
        return "numpy is not installed; Triton's interpreter (the CPU path) needs it: pip install numpy"
    if isinstance(e, ModuleNotFoundError) and root == "triton":
        return "triton is not installed: pip install 'triton>=3.6'"
    return f"{type(e).__name__}: {e}"


def kernel_import_error(modules: Sequence[str] = (KERNEL_MODULE,)) -> str | None:
    """Import the kernel modules; ``None`` when they import, else why they cannot (for the user).

    Call it after ``TRITON_INTERPRET`` has been decided: with ``TRITON_INTERPRET=1`` Triton
    imports NumPy, without it Triton does not.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            return describe_import_error(e)
    return None


def triton_version() -> str:
    """``triton.__version__``, or ``unavailable: <the real cause>``."""
    try:
        import triton
    except ImportError as e:
        return f"unavailable: {describe_import_error(e)}"
    return str(triton.__version__)


@contextlib.contextmanager
def quiet_interpreter() -> Iterator[None]:
    """Silence NumPy's floating-point warnings while Triton's interpreter runs kernels.

    The interpreter executes kernels through NumPy, so masked-out work (a query or a block with
    no valid key: ``-inf - -inf``, ``log2(0)``) raises ``RuntimeWarning: invalid value
    encountered ...`` that compiled kernels never show; the results are right (the kernels select
    around those lanes). Used by the CLI around kernel calls only, never at library import.
    """
    try:
        import numpy as np
    except ImportError:
        yield
        return
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        yield
