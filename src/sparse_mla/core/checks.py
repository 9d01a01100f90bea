"""Argument and storage checks every operation shares: each raises ``TypeError`` or ``ValueError``
naming the argument and what was expected, and none reads a device value (no host sync).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

__all__ = [
    "shown",
    "shape_of",
    "shape_text",
    "check_tensor",
    "check_vector",
    "check_scale",
    "check_block_table",
    "check_plain_storage",
    "check_apart",
    "check_no_self_overlap",
    "storage_extent",
    "byte_range",
]


def shown(value: Any) -> Any:
    """``value`` for an error message: an int or float as itself, anything else unchanged.

    Under ``torch.compile`` a dynamic size or Python number is symbolic, and Dynamo cannot put a
    symbolic number into a string (a graph break: ``BUILD_STRING type error``); ``int()`` /
    ``float()`` read its value instead (specialising the graph of a call that raises anyway)."""
    if type(value) is int:
        return int(value)
    if type(value) is float:
        return float(value)
    return value


def shape_text(dims: Any) -> str:
    """``str(list(dims))`` (``"[2, 1, 16, 576]"``) for an error message, symbolic sizes read as their
    values (:func:`shown`; Dynamo cannot turn a list of them into a string, but joins their texts)."""
    return "[" + ", ".join(f"{int(n)}" for n in dims) + "]"


def shape_of(x: torch.Tensor) -> str:
    """:func:`shape_text` of ``x.shape``."""
    return shape_text(x.shape)


def check_tensor(
    x: Any, name: str, dtypes: tuple, dim: int, device: torch.device | None = None, device_of: str = "q"
) -> torch.Tensor:
    """``x`` is a tensor of one of ``dtypes`` with ``dim`` dimensions (on ``device``, the device of
    the argument ``device_of``), else ``TypeError``/``ValueError`` naming ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {x.dtype}")
    if x.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor, got shape {shape_of(x)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where {device_of} is), got {x.device}")
    check_plain_storage(x, name)
    return x


def check_vector(x: Any, name: str, dtype: torch.dtype, n: int, n_name: str, dev: torch.device) -> torch.Tensor | None:
    """An optional 1-D ``[n]`` tensor, returned contiguous: the kernels index it as ``ptr + i``, so
    a view (strided, expanded, offset) becomes a copy on the device (no host synchronisation)."""
    if x is None:
        return None
    check_tensor(x, name, (dtype,), 1, dev)
    if x.shape[0] != n:
        raise ValueError(f"{name}: expected shape [{n_name}={n}], got {list(x.shape)}")
    return x.contiguous()


def check_scale(value: Any, name: str, expected: str = "a float") -> float:
    """A finite positive real number (not a bool) as a float, else ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:  # an int or Fraction beyond float64
        raise ValueError(f"{name}: expected a finite positive float (as float32), got {shown(value)!r}") from None
    # the kernels take it as float32: it must stay finite and non-zero there too (rounded to
    # nearest even, 2^-150 becomes 0 and the float32 maximum plus half an ulp becomes inf; plain
    # Python, so that torch.compile traces it)
    if not (_F32_ZERO_EDGE < v < _F32_INF_EDGE):
        raise ValueError(f"{name}: expected a finite positive float (as float32), got {shown(value)!r}")
    return v


_F32_ZERO_EDGE = 2.0**-150
_F32_INF_EDGE = (2.0 - 2.0**-24) * 2.0**127


def check_block_table(
    block_table: torch.Tensor, b: int, device: torch.device, page_block_size: int, device_of: str = "the indices"
) -> None:
    """``block_table`` an int32/int64 ``[b, max_blocks_per_seq]`` tensor on ``device`` (the device of
    the argument ``device_of`` names, for the error message), and ``page_block_size`` an int in
    ``[1, 2^31 - 1]``."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype not in (torch.int32, torch.int64):
        got = block_table.dtype if isinstance(block_table, torch.Tensor) else type(block_table).__name__
        raise TypeError(f"block_table: expected an int32 or int64 tensor [b, max_blocks_per_seq], got {got}")
    if (
        isinstance(page_block_size, bool)
        or not isinstance(page_block_size, numbers.Integral)
        or not 0 < page_block_size < 2**31
    ):
        raise ValueError(f"page_block_size: expected an int in [1, 2^31 - 1], got {page_block_size!r}")
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table: expected shape [b={b}, max_blocks_per_seq], got {list(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table: must be on the same device as {device_of} ({device})")
    check_plain_storage(block_table, "block_table")  # the kernels read its raw bits, inside its storage


def storage_extent(x: torch.Tensor) -> int:
    """Bytes from ``x``'s first element to one past its last (0 for an empty tensor)."""
    if x.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True))) * x.element_size()


def check_plain_storage(x: torch.Tensor, name: str) -> None:
    """``x`` is a dense tensor whose elements the kernels can read as stored: strided layout, not
    a lazily negated or conjugated view (the kernels read the raw bits), not a zero tensor without
    storage, and every element inside its storage (a storage shrunk under a view is refused)."""
    if torch.compiler.is_compiling():
        return  # (traced: no storage to bound; the operators check their real tensors when they run)
    if x.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}")
    if x.is_neg() or x.is_conj():
        raise ValueError(f"{name}: a lazily negated or conjugated view; pass {name}.resolve_neg() / .resolve_conj()")
    if x._is_zerotensor():
        raise ValueError(f"{name}: a zero tensor without storage; pass a materialised tensor (torch.zeros)")
    if x.device.type == "meta":
        return  # (refused by device checks where it matters; a meta tensor has no bytes to bound)
    end = x.storage_offset() * x.element_size() + storage_extent(x)
    if end > x.untyped_storage().nbytes():
        raise ValueError(f"{name}: its elements run {end - x.untyped_storage().nbytes()} bytes past its storage")


def check_apart(out: torch.Tensor, name: str, inputs) -> None:
    """Raise ``ValueError`` naming ``name`` when the output ``out``'s bytes (from its first element to
    its last) meet those of any tensor of ``inputs`` (None and empty ones skipped): a kernel that
    writes ``out`` while it reads them would read its own writes. A sufficient rule on byte spans,
    so interleaved views that never share an element are refused too."""
    if out.numel() == 0 or out.device.type == "meta":
        return
    lo, hi = byte_range(out)
    for t in inputs:
        if t is not None and t.numel() > 0 and t.device == out.device:
            t_lo, t_hi = byte_range(t)
            if t_lo <= hi and lo <= t_hi:
                raise ValueError(f"{name}: must not overlap an input in memory")


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last]`` byte addresses a non-empty tensor's elements touch (strides are never
    negative: the first is the data pointer)."""
    lo = t.data_ptr()
    return lo, lo + storage_extent(t) - 1


def check_no_self_overlap(t: torch.Tensor, name: str) -> None:
    """An output buffer must hold each element once (no expanded or otherwise self-overlapping
    strides: checked by the sufficient rule that each stride, in increasing order, exceeds the
    span of the smaller ones)."""
    if t.numel() == 0:
        return
    span = 0
    for n, st in sorted(((n, abs(st)) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1), key=lambda x: x[1]):
        if st <= span:
            raise ValueError(
                f"{name}: its elements overlap in memory (expanded or overlapping strides {tuple(t.stride())})"
            )
        span += (n - 1) * st
