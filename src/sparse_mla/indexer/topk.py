"""Top-k of indexer logits, and the fused variant that returns the decode's cache indices.

Ranking rule (exact, deterministic): larger logit first; equal logits by smaller position; NaN
after ``-inf``; ``-0.0`` equals ``+0.0``. Only positions in a row's ``[row_starts[r], row_ends[r])``
(default the whole row) are candidates; a row with fewer than ``k`` candidates gets ``-1`` in its
last entries. Implementation: each logit becomes one int64 rank key (the float's order-preserving
32 bits above the inverted position), all distinct, so the set is exact with no tie ambiguity.
On CUDA (and under the interpreter) Triton kernels (:func:`.kernels.launch_topk`) find the row's
k-th best 32-bit key. A row of 8192 to 32768 entries takes the split path: a threshold from a
fixed sample of the row, the rank keys at or above it streamed out by chunk programs, one program
a row finishing the k-th key on that list (or, for a row the sample misjudges, by a radix select
over the row).
A row of up to 32768 entries is read once into one program's registers and
the key's top bits found from the top by counts of the keys at or above a candidate (no histogram:
for the top bit a compare and an add per entry, for bits 30..17 two entries at a time in fp16 lanes)
until at most 2 k keys are at or above them; their positions are gathered into a list, the remaining
bits found on it (the keys read from the row again), and the row's entries above the k-th key and the first ones equal to it are written.
A longer row takes a radix select: two 8-bit histogram levels over row segments fix its top 16
bits, a split pass writes the entries above that bucket and gathers the bucket's entries into a
candidate list, and one program per row finishes the select on that list (on the row when the
bucket is larger than the list's capacity), sorts the k rank keys (unless ``sorted=False``) and
writes the positions, or, for :func:`topk_kvcache_indices`, the cache slots they map to; elsewhere one
``torch.topk`` over all the rank keys (:func:`rank_keys`). No host synchronisation (CUDA-graph
safe). Twin: :func:`sparse_mla.indexer.reference.topk_indices_reference`.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..core.checks import check_block_table, shown
from ..core.env import next_pow2, on_tensor_device
from ..core.traced import deferred_output
from ..kvcache.reference import abs_indices_to_kvcache_indices
from .backends import INDEXER_BACKENDS
from .problem import INT32_MAX, check_tensor_arg, type_name

__all__ = ["topk_indices", "topk_kvcache_indices", "rank_keys", "MAX_PADDED_K"]

_LOW = (1 << 32) - 1

#: the largest ``k`` accepted beyond a row's width (the output is ``[rows, k]``, ``-1`` past the row):
#: four times the largest attention topk in use (16384)
MAX_PADDED_K = 65536


def rank_keys(logits: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``[rows, n]`` int64 keys ordering a row's candidates by the ranking rule (larger first);
    positions outside ``[lo[r], hi[r])`` get the smallest int64."""
    rows, n = logits.shape
    v = logits.float() + 0.0  # -0.0 -> +0.0
    bits = v.view(torch.int32)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    neg_inf_key = (torch.tensor(float("-inf")).view(torch.int32) ^ 0x7FFFFFFF).long().item()
    key = torch.where(torch.isnan(v), torch.full_like(key, neg_inf_key - 1), key)
    pos = torch.arange(n, device=logits.device, dtype=torch.int64)
    comp = key * (1 << 32) + (_LOW - pos)
    inside = (pos.view(1, -1) >= lo.view(-1, 1)) & (pos.view(1, -1) < hi.view(-1, 1))
    return torch.where(inside, comp, torch.full_like(comp, torch.iinfo(torch.int64).min))


def _check_range(x: Any, name: str, rows: int, dev: torch.device) -> torch.Tensor | None:
    if x is None:
        return None
    check_tensor_arg(x, name, (torch.int32, torch.int64), 1, dev)
    if x.shape[0] != rows:
        raise ValueError(f"{name}: expected shape [rows={rows}], got {list(x.shape)}")
    return x


@on_tensor_device
def topk_indices(
    logits: torch.Tensor,
    k: int,
    row_starts: torch.Tensor | None = None,
    row_ends: torch.Tensor | None = None,
    *,
    sorted: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """The ``k`` best positions of each row of ``logits`` (module doc for the ranking rule).

    Args:
        logits: ``[rows, n]`` fp32 (fp16/bf16 accepted).
        k: positions per row (>= 1). It may exceed ``n`` up to :data:`MAX_PADDED_K` (an attention's
            topk over a short context: the row is padded with ``-1``); a ``k`` above both is a
            ``ValueError`` before anything is allocated.
        row_starts, row_ends: optional ``[rows]`` int32/int64: row ``r``'s candidates are
            positions ``row_starts[r] <= j < row_ends[r]`` (clamped to ``[0, n]``).
        sorted: True: the positions in rank order. False: the same set in no set order (the
            kernels leave their final sort out; the attention does not need the order), still
            first in the row and ``-1`` after them.
        backend: ``"auto"``, ``"portable"`` (the Triton kernels) or ``"reference"`` (the PyTorch
            twin), resolved as every operation's (:mod:`sparse_mla.core.backend`).

    Returns:
        ``[rows, k]`` int32 positions, ``-1`` past a row's number of candidates.

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype, shape or device, or a
            ``backend`` that is unknown or cannot serve the tensors' device.
    """
    if torch.compiler.is_compiling():  # one operator in the graph (its tensors checked when it runs)
        try:  # the scalars, dtype and dims are fixed while tracing: a failed check raises when the graph runs
            _check_k(k)
            _check_sorted(sorted)
            check_tensor_arg(logits, "logits", (torch.float32, torch.float16, torch.bfloat16), 2)
        except (TypeError, ValueError) as e:
            return deferred_output(e, logits, (_rows(logits), 0))
        return torch.ops.sparse_mla.topk_indices(logits, int(k), row_starts, row_ends, sorted, backend)
    _check_k(k)
    _check_sorted(sorted)
    return _topk(logits, int(k), row_starts, row_ends, ordered=sorted, backend=backend)


def _topk(
    logits: torch.Tensor,
    k: int,
    row_starts: torch.Tensor | None,
    row_ends: torch.Tensor | None,
    table: torch.Tensor | None = None,
    page_block_size: int = 1,
    next_n: int = 1,
    ordered: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`topk_indices` after its ``k`` check; with ``table`` the positions are mapped to cache
    slots (``[rows, k]``; the caller checked ``table``, ``page_block_size`` and ``next_n``);
    ``ordered`` False lets the kernels leave their sort out."""
    check_tensor_arg(logits, "logits", (torch.float32, torch.float16, torch.bfloat16), 2)  # CPU or CUDA
    rows, n = logits.shape
    if k > max(n, MAX_PADDED_K):
        raise ValueError(
            f"k: {k} is more than the row's {n} positions and than {MAX_PADDED_K}, the most a row is padded to "
            "with -1 (an attention's topk over a short context)"
        )
    dev = logits.device
    lo = _check_range(row_starts, "row_starts", rows, dev)
    hi = _check_range(row_ends, "row_ends", rows, dev)
    kernels = INDEXER_BACKENDS.runs_kernels(dev, backend)
    kk = min(k, n)
    if rows and kk and kernels:  # select, sort, positions (or slots); the kernels clamp lo, hi
        from .kernels import launch_topk

        x = logits if logits.stride(1) == 1 else logits.contiguous()
        lo = None if lo is None else lo.contiguous()  # (None: from 0 / to n, nothing to fill)
        hi = None if hi is None else hi.contiguous()
        covered = k <= next_pow2(kk)  # the kernel writes columns < next_pow2(kk)
        out = torch.empty((rows, k), dtype=torch.int32, device=dev) if covered else _minus_one((rows, k), dev)
        launch_topk(x, lo, hi, out, k, kk, table, page_block_size, next_n, ordered=ordered, _checked=True)
        return out
    lo = torch.zeros(rows, dtype=torch.int64, device=dev) if lo is None else lo.long().clamp(0, n)
    hi = torch.full((rows,), n, dtype=torch.int64, device=dev) if hi is None else hi.long().clamp(0, n)
    out = _minus_one((rows, k), dev)
    if rows and kk:
        top = torch.topk(rank_keys(logits, lo, hi), kk, dim=1, largest=True, sorted=True).values
        pos = (_LOW - (top & _LOW)).to(torch.int32)
        count = (hi - lo).clamp(min=0).view(-1, 1)
        rank = torch.arange(kk, device=dev).view(1, -1)
        out[:, :kk] = torch.where(rank < count, pos, torch.full_like(pos, -1))
    if table is not None:
        out = abs_indices_to_kvcache_indices(out.view(rows // next_n, next_n, k), table, page_block_size).view(rows, k)
    return out


def _check_next_n(next_n: Any) -> None:
    if isinstance(next_n, bool) or not isinstance(next_n, numbers.Integral) or next_n < 1:
        raise ValueError(f"next_n: expected an int >= 1, got {shown(next_n)!r}")


def _rows(logits: Any) -> int:
    """Rows of ``logits`` as far as a traced call can tell (0 for what is not a 2-D tensor)."""
    return logits.shape[0] if isinstance(logits, torch.Tensor) and logits.dim() == 2 else 0


def _check_sorted(x: Any) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"sorted: expected a bool, got {type_name(x)}")


def _check_k(k: Any) -> None:
    if isinstance(k, bool) or not isinstance(k, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"k: expected an int, got {type_name(k)}")
    if not 1 <= k <= INT32_MAX:
        raise ValueError(f"k: expected an int in [1, 2^31 - 1] (int32 positions), got {shown(k)!r}")


def _minus_one(shape: tuple[int, int], dev: torch.device) -> torch.Tensor:
    return torch.full(shape, -1, dtype=torch.int32, device=dev)


@on_tensor_device
def topk_kvcache_indices(
    logits: torch.Tensor,
    k: int,
    block_table: torch.Tensor,
    page_block_size: int,
    next_n: int = 1,
    row_starts: torch.Tensor | None = None,
    row_ends: torch.Tensor | None = None,
    *,
    sorted: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`topk_indices` turned into the decode's ``indices``: cache slots through the block table.

    Args:
        logits: ``[b * next_n, n]`` (the rows of :func:`~sparse_mla.indexer.fp8_paged_mqa_logits`).
        k: top-k (the decode's ``topk``).
        block_table: ``[b, max_blocks]`` int32 of the attention cache.
        page_block_size: its page size.
        next_n: query tokens per request (the decode's ``s_q``).
        row_starts, row_ends: as :func:`topk_indices` (for a decode step ``row_ends[i * next_n + p] =
            context_lens[i] - next_n + p + 1``).
        sorted: as :func:`topk_indices` (False: the same slots in no set order, which the decode
            does not need).
        backend: as :func:`topk_indices`.

    Returns:
        ``[b, next_n, k]`` int32 ``block * page_block_size + offset`` (``-1`` for no key), ready as
        ``flash_mla_with_kvcache(..., indices=...)``.
    """
    if torch.compiler.is_compiling():  # the top-k operator, then the slot map in torch ops
        try:  # the scalars and the row count are fixed while tracing: a failed check raises when the graph runs
            _check_next_n(next_n)
            _check_sorted(sorted)
            _check_k(k)
            if _rows(logits) % next_n:
                raise ValueError(f"logits: rows ({_rows(logits)}) must be b * next_n with next_n={next_n}")
        except (TypeError, ValueError) as e:
            return deferred_output(e, logits, (0, 1, 0))
        pos = topk_indices(logits, k, row_starts, row_ends, sorted=sorted, backend=backend)
        rows = pos.shape[0]
        return abs_indices_to_kvcache_indices(pos.view(rows // next_n, next_n, -1), block_table, page_block_size)
    _check_next_n(next_n)
    _check_sorted(sorted)
    _check_k(k)
    check_tensor_arg(logits, "logits", (torch.float32, torch.float16, torch.bfloat16), 2)
    rows = logits.shape[0]
    if rows % next_n:
        raise ValueError(f"logits: rows ({rows}) must be b * next_n with next_n={next_n}")
    b = rows // next_n
    check_block_table(block_table, b, logits.device, page_block_size, "logits")
    page_block_size = int(page_block_size)  # (a NumPy integer passes the check)
    table = block_table if block_table.shape[1] < 2 or block_table.stride(1) == 1 else block_table.contiguous()
    out = _topk(
        logits, int(k), row_starts, row_ends, table, page_block_size, int(next_n), ordered=sorted, backend=backend
    )
    return out.view(b, int(next_n), int(k))
