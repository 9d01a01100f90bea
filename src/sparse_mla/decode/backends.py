"""The decode dispatcher: which implementation serves a :class:`~sparse_mla.decode.problem.DecodeProblem`.

Each backend says whether it can serve a problem and, if not, why (:meth:`Backend.unsupported`),
how many query heads one of its programs serves (the scheduler sizes the partitions from it:
:meth:`Backend.heads_per_cta`), and launches its kernels (:meth:`Backend.launch`):

=============  ==========================================================================
``hopper``     warp-specialised Gluon kernel (:mod:`.hopper`): sm_90 GPUs, both caches
               (V32, MODEL1) and every feature of the sparse decode, compiled (not
               interpreted); not the dense decode
``portable``   Triton ``tl`` kernels (:mod:`.portable`, sparse and dense): any GPU Triton
               supports, and the CPU under Triton's interpreter (``TRITON_INTERPRET=1``);
               every feature, sparse and dense
``reference``  fp32 PyTorch twin (:mod:`.reference`; sparse: replaying the schedule): anywhere
=============  ==========================================================================

``backend="auto"`` takes the first of those that serves the problem. The environment variable
``SPARSE_MLA_BACKEND`` (read in :mod:`sparse_mla.core.env`) replaces ``"auto"`` for debugging.
Kernel modules are imported on first launch, so ``import sparse_mla`` imports no Triton.

To add a backend: write its kernel module with a ``launch(p, table, config, workspace) -> (out, lse)``
(writing into ``p.out``/``p.lse`` when the caller gave them),
subclass :class:`Backend` here, and put it in :data:`DECODE_BACKENDS` (its order is the one
``"auto"`` tries); the tests in ``tests/decode/test_backends.py`` then run it where it applies.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import backend as core_backend
from ..core.backend import Anywhere, BackendSet, HopperOnly, TritonOnly, check_backend_override
from ..core.env import use_triton
from .problem import DecodeProblem, empty_outputs, finish_outputs, is_empty
from .scheduler import (
    META_FIELDS,
    ScheduleTable,
    compute_num_sm_parts,
    dynamic_acc_rows,
    hopper_head_tile,
    length_block_counts,
    schedule_from_lengths,
    small_head_tile,
)

#: ``(o_accum [rows, s_q, h_q, d_v], lse_accum [rows, s_q, h_q])`` fp32 split accumulators
Workspace = tuple[torch.Tensor, torch.Tensor]

__all__ = [
    "Workspace",
    "Backend",
    "DECODE_BACKENDS",
    "check_backend_override",
    "BACKENDS",
    "AUTO_ORDER",
    "resolve_backend",
    "backend_support",
    "get_backend",
    "run_decode",
    "dynamic_table",
    "schedule_lengths",
]


class Backend(core_backend.Backend):
    """One implementation of the split-KV sparse decode (and its combine): the shared protocol
    (:class:`sparse_mla.core.backend.Backend`: ``name``, ``unsupported(p)``, ``launch``) plus the
    head tile the schedule is sized for."""

    #: whether a schedule made from lengths comes from the PyTorch twin (the reference) rather
    #: than the Triton kernel (:func:`schedule_lengths`)
    twin_schedule = False

    def heads_per_cta(self, h_q: int) -> int:
        """Query heads one program serves (the schedule has ``ceil(h_q / this)`` programs per
        partition and query token)."""
        raise NotImplementedError

    def num_sm_parts(self, num_sms: int, s_q: int, h_q: int) -> int:
        """Partitions of the schedule per query token (default: programs of
        :meth:`heads_per_cta` heads about filling ``num_sms`` SMs once)."""
        return compute_num_sm_parts(num_sms, s_q, h_q, self.heads_per_cta(h_q))

    def launch(
        self, p: DecodeProblem, table: ScheduleTable, config: Any = None, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the decode (and the combine when some batch is split): ``(out bf16, lse fp32)``,
        written into ``p.out``/``p.lse`` when given.

        ``config``: the backend's tuning dataclass (None = the measured defaults). ``workspace``:
        ``(o_accum, lse_accum)`` with at least ``table.num_acc_rows`` rows, or None to allocate."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<sparse_mla decode backend {self.name!r}>"


class ReferenceBackend(Anywhere, Backend):
    twin_schedule = True

    def heads_per_cta(self, h_q: int) -> int:
        return small_head_tile(h_q)

    def launch(
        self, p: DecodeProblem, table: ScheduleTable, config: Any = None, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from .reference import dense_decode_reference, sparse_decode_split_reference

        if p.is_dense:  # the direct twin (the schedule does not change the function)
            out, lse = dense_decode_reference(p.q, p.k_cache, p.block_table, p.topk_length, p.sm_scale, p.d_v, p.causal)
            return finish_outputs(p, out, lse)

        out, lse = sparse_decode_split_reference(
            p.q,
            p.k_cache,
            p.indices,
            table,
            p.sm_scale,
            p.d_v,
            p.topk_length,
            p.attn_sink,
            p.extra_k_cache,
            p.extra_indices,
            p.extra_topk_length,
        )
        return finish_outputs(p, out, lse)


class PortableBackend(TritonOnly, Backend):
    def heads_per_cta(self, h_q: int) -> int:
        return small_head_tile(h_q)

    def launch(
        self, p: DecodeProblem, table: ScheduleTable, config: Any = None, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from .kernels.portable import launch

        return launch(p, table, config, workspace)


class HopperBackend(HopperOnly, Backend):
    def unsupported(self, problem: Any) -> str | None:
        if getattr(problem, "is_dense", False):
            return "serves the sparse decode only; the 'portable' backend serves the dense decode (and 'reference' anywhere)"
        return super().unsupported(problem)

    def heads_per_cta(self, h_q: int) -> int:
        # h_q <= 32: the heads are the wgmma's N (16 or 32); else 64-head tiles (one wgmma M), whose
        # rows past h_q are zero queries, never stored
        return hopper_head_tile(h_q)

    def launch(
        self, p: DecodeProblem, table: ScheduleTable, config: Any = None, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from .kernels.hopper import launch

        return launch(p, table, config, workspace)


#: the decode's backends, in the order ``backend="auto"`` tries them (fastest first)
DECODE_BACKENDS = BackendSet("decode", (HopperBackend(), PortableBackend(), ReferenceBackend()))
#: every backend by name
BACKENDS: dict[str, Backend] = DECODE_BACKENDS.by_name
#: the order in which ``backend="auto"`` tries them
AUTO_ORDER = DECODE_BACKENDS.auto_order


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (``"hopper"``, ``"portable"``, ``"reference"``).

    Raises:
        TypeError / ValueError: not a string, or no such backend.
    """
    return DECODE_BACKENDS.get(name)


def backend_support(p: DecodeProblem) -> dict[str, str | None]:
    """For each backend: None if it serves ``p``, else why not."""
    return DECODE_BACKENDS.support(p)


def resolve_backend(p: DecodeProblem, backend: str = "auto") -> Backend:
    """The backend that will run ``p`` (:meth:`sparse_mla.core.backend.BackendSet.resolve`).

    Raises:
        TypeError / ValueError: unknown name, or the requested backend cannot serve ``p`` (the
            message says why).
    """
    return DECODE_BACKENDS.resolve(p, backend)


def run_decode(
    p: DecodeProblem,
    backend: Backend,
    table: ScheduleTable,
    config: Any = None,
    workspace: Workspace | None = None,
    own_table: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``backend`` on a validated problem with its schedule (and ``workspace``, None to
    allocate); an empty step (``b = 0`` or ``s_q = 0``) launches nothing and gets empty outputs.
    A ``dynamic`` table is first remade on the device from this call's lengths
    (:func:`schedule_lengths`): into ``table``'s own tensors when ``own_table`` (the caller's
    scheduler object holds them and runs its calls one after another on one stream), else into
    new ones (a call being captured in a CUDA graph, whose graph may outlive the object).
    Returns ``(out bf16, lse fp32)``."""
    if is_empty(p):
        return empty_outputs(p)
    if table.dynamic:
        into = (
            table
            if own_table
            else dynamic_table(table.main_blocks.shape[0], table.num_sm_parts, p.q.device, table.max_pieces)
        )
        table = schedule_lengths(p, into, kernel=not backend.twin_schedule)
    return backend.launch(p, table, config, workspace)


def dynamic_table(b: int, num_sm_parts: int, device: torch.device, max_pieces: int = 0) -> ScheduleTable:
    """An unfilled ``dynamic`` :class:`ScheduleTable` (one int32 allocation for all its tensors)."""
    fields = len(META_FIELDS)
    sizes = [num_sm_parts * fields, b + 1, b + 1, b, b, num_sm_parts + 1]
    buf = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    meta, ns, acc, main, nb, listed = torch.split(buf, sizes)
    return ScheduleTable(
        num_sm_parts=num_sm_parts,
        metadata=meta.view(num_sm_parts, fields),
        num_splits=ns,
        main_blocks=main,
        num_blocks=[],
        payload=0,
        num_blocks_t=nb,
        acc_rows=acc,
        num_acc_rows=dynamic_acc_rows(b, num_sm_parts),
        max_pieces=max_pieces,
        dynamic=True,
        split_list=listed,
    )


def schedule_lengths(p: DecodeProblem, into: ScheduleTable, kernel: bool = True) -> ScheduleTable:
    """Write the schedule of ``p``'s lengths into ``into`` (a ``dynamic`` table sized for ``p``)
    and return it: with ``kernel``, the Triton kernel where Triton runs (:mod:`.kernels.schedule`),
    else its PyTorch twin; neither reads a value on the host."""
    if kernel and use_triton(p.q.device):
        from .kernels.schedule import schedule_fwd

        return schedule_fwd(p.topk_length, p.extra_topk_length, p.topk, p.extra_topk, into)
    main, total = length_block_counts(p.shape[0], p.topk, p.topk_length, p.extra_topk, p.extra_topk_length, p.q.device)
    made = schedule_from_lengths(main, total, into.num_sm_parts)
    for name in ("metadata", "num_splits", "acc_rows", "main_blocks", "num_blocks_t", "split_list"):
        getattr(into, name).copy_(getattr(made, name))
    return into
