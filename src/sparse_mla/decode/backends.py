"""The decode dispatcher: which implementation serves a :class:`~sparse_mla.decode.problem.DecodeProblem`.

Each backend says whether it can serve a problem and, if not, why (:meth:`Backend.unsupported`),
how many query heads one of its programs serves (the scheduler sizes the partitions from it:
:meth:`Backend.heads_per_cta`), and launches its kernels (:meth:`Backend.launch`):

=============  ==========================================================================
``hopper``     warp-specialised Gluon kernel (:mod:`.hopper`): sm_90 GPUs, both caches
               (V32, MODEL1) and every feature, compiled (not interpreted)
``portable``   Triton ``tl`` kernel (:mod:`.portable`): any GPU Triton supports, and the CPU
               under Triton's interpreter (``TRITON_INTERPRET=1``); every feature
``reference``  fp32 PyTorch twin replaying the schedule (:mod:`.reference`): anywhere
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
from .problem import DecodeProblem, empty_outputs, finish_outputs, is_empty
from .scheduler import ScheduleTable, compute_num_sm_parts, hopper_head_tile, small_head_tile

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
]


class Backend(core_backend.Backend):
    """One implementation of the split-KV sparse decode (and its combine): the shared protocol
    (:class:`sparse_mla.core.backend.Backend`: ``name``, ``unsupported(p)``, ``launch``) plus the
    head tile the schedule is sized for."""

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
    def heads_per_cta(self, h_q: int) -> int:
        return small_head_tile(h_q)

    def launch(
        self, p: DecodeProblem, table: ScheduleTable, config: Any = None, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from .reference import sparse_decode_split_reference

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
    p: DecodeProblem, backend: Backend, table: ScheduleTable, config: Any = None, workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``backend`` on a validated problem with its schedule (and ``workspace``, None to
    allocate); an empty step (``b = 0`` or ``s_q = 0``) launches nothing and gets empty outputs.
    Returns ``(out bf16, lse fp32)``."""
    if is_empty(p):
        return empty_outputs(p)
    return backend.launch(p, table, config, workspace)
