"""The decode dispatcher: which implementation serves a :class:`~sparse_mla.problem.DecodeProblem`.

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
``SPARSE_MLA_BACKEND`` (read in :mod:`sparse_mla.runtime`) replaces ``"auto"`` for debugging.
Kernel modules are imported on first launch, so ``import sparse_mla`` imports no Triton.

To add a backend: write its kernel module with a ``launch(p, table, config, workspace) -> (out, lse)``
(writing into ``p.out``/``p.lse`` when the caller gave them),
subclass :class:`Backend` here, and put it in :data:`BACKENDS` (and :data:`AUTO_ORDER` if
"auto" may pick it); the tests in ``tests/test_backends.py`` then run it where it applies.
"""

from __future__ import annotations

from typing import Any

import torch

from ..problem import DecodeProblem, empty_outputs, finish_outputs, is_empty
from ..runtime import backend_override, interpreting, use_triton
from ..scheduler import ScheduleTable, compute_num_sm_parts, hopper_head_tile, small_head_tile

#: ``(o_accum [rows, s_q, h_q, d_v], lse_accum [rows, s_q, h_q])`` fp32 split accumulators
Workspace = tuple[torch.Tensor, torch.Tensor]

__all__ = [
    "Workspace",
    "Backend",
    "BACKENDS",
    "AUTO_ORDER",
    "resolve_backend",
    "backend_support",
    "get_backend",
    "run_decode",
]


class Backend:
    """One implementation of the split-KV sparse decode (and its combine)."""

    name: str = ""

    def unsupported(self, p: DecodeProblem) -> str | None:
        """None when this backend serves ``p``, else why not, as a phrase that follows "it"
        ("needs an sm_90 (Hopper) GPU, ...")."""
        raise NotImplementedError

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


class ReferenceBackend(Backend):
    name = "reference"

    def unsupported(self, p: DecodeProblem) -> str | None:
        return None

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


class PortableBackend(Backend):
    name = "portable"

    def unsupported(self, p: DecodeProblem) -> str | None:
        if not use_triton(p.q.device):
            return "runs CPU tensors only under Triton's interpreter (set TRITON_INTERPRET=1 before Python starts)"
        return None

    def heads_per_cta(self, h_q: int) -> int:
        return small_head_tile(h_q)

    def launch(
        self, p: DecodeProblem, table: ScheduleTable, config: Any = None, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from .portable import launch

        return launch(p, table, config, workspace)


def hopper_unsupported(dev: torch.device) -> str | None:
    """Why the Gluon Hopper kernel cannot run on ``dev`` (None when it can): it needs compiled
    kernels on an sm_90 GPU (the decode's ``hopper`` backend and the prefill's)."""
    if dev.type != "cuda" or interpreting():
        return "needs a CUDA device and compiled kernels (not TRITON_INTERPRET=1)"
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 9:
        return f"needs an sm_90 (Hopper) GPU, this one is sm_{major}{minor}"
    return None


class HopperBackend(Backend):
    name = "hopper"

    def unsupported(self, p: DecodeProblem) -> str | None:
        return hopper_unsupported(p.q.device)

    def heads_per_cta(self, h_q: int) -> int:
        # h_q <= 32: the heads are the wgmma's N (16 or 32); else 64-head tiles (one wgmma M), whose
        # rows past h_q are zero queries, never stored
        return hopper_head_tile(h_q)

    def launch(
        self, p: DecodeProblem, table: ScheduleTable, config: Any = None, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from .hopper import launch

        return launch(p, table, config, workspace)


#: every backend by name
BACKENDS: dict[str, Backend] = {b.name: b for b in (HopperBackend(), PortableBackend(), ReferenceBackend())}
#: the order in which ``backend="auto"`` tries them (fastest first)
AUTO_ORDER = ("hopper", "portable", "reference")
_ALIASES = {"gluon": "hopper", "tl": "portable", "triton": "portable"}  # earlier SPARSE_MLA_BACKEND values


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (``"hopper"``, ``"portable"``, ``"reference"``).

    Raises:
        TypeError / ValueError: not a string, or no such backend.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a str, got {type(name).__name__}")
    key = _ALIASES.get(name, name)
    if key not in BACKENDS:
        raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[key]


def check_backend_override() -> None:
    """Check ``SPARSE_MLA_BACKEND`` up front (the CLI does, whichever path a command takes).

    Raises:
        ValueError: it is set to a name that is neither ``auto`` nor a backend.
    """
    name = backend_override()
    if name is not None and _ALIASES.get(name, name) not in BACKENDS:
        raise ValueError(f"SPARSE_MLA_BACKEND: expected 'auto' or one of {sorted(BACKENDS)}, got {name!r}")


def backend_support(p: DecodeProblem) -> dict[str, str | None]:
    """For each backend: None if it serves ``p``, else why not."""
    return {name: BACKENDS[name].unsupported(p) for name in AUTO_ORDER}


def resolve_backend(p: DecodeProblem, backend: str = "auto") -> Backend:
    """The backend that will run ``p``: the requested one, or for ``"auto"`` the first of
    :data:`AUTO_ORDER` that serves it (``SPARSE_MLA_BACKEND``, if set, replaces ``"auto"``).

    Raises:
        TypeError / ValueError: unknown name, or the requested backend cannot serve ``p`` (the
            message says why).
    """
    source = "backend"
    override = backend_override() if backend == "auto" else None
    if override is not None:  # (an unknown name fails below, named as the variable)
        backend, source = override, "SPARSE_MLA_BACKEND"
    if backend == "auto":
        for name in AUTO_ORDER:
            if BACKENDS[name].unsupported(p) is None:
                return BACKENDS[name]
        raise AssertionError("the reference backend serves every problem")  # pragma: no cover
    try:
        b = get_backend(backend)
    except ValueError:
        raise ValueError(f"{source}: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}") from None
    reason = b.unsupported(p)
    if reason is not None:
        raise ValueError(f"{source}: the {b.name!r} backend cannot serve this call: it {reason}")
    return b


def run_decode(
    p: DecodeProblem, backend: Backend, table: ScheduleTable, config: Any = None, workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``backend`` on a validated problem with its schedule (and ``workspace``, None to
    allocate); an empty step (``b = 0`` or ``s_q = 0``) launches nothing and gets empty outputs.
    Returns ``(out bf16, lse fp32)``."""
    if is_empty(p):
        return empty_outputs(p)
    return backend.launch(p, table, config, workspace)
