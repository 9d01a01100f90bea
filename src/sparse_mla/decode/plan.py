"""The plan of a decode step: which backend runs it, and the tile schedule sized for that backend
(stage 3 of the decode path; step 3 in docs/design.md).

:class:`FlashMLASchedMeta` (FlashMLA 1.0's scheduler object) holds the plan. It is filled on the
first call of a decode step and reused by later calls with the same :class:`ScheduleConfig`. No
call reads a tensor's values on the host (CUDA-graph safe). Without ``topk_length`` the schedule
depends on the shapes alone; with it, every call remakes the schedule on the device from its own
lengths, so an object stays right when the lengths change between calls or graph replays.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..core.env import cuda_num_sms
from .backends import (
    AUTO_ORDER,
    BACKENDS,
    Backend,
    Workspace,
    dynamic_table,
    get_backend,
    resolve_backend,
)
from .problem import MAX_H_Q, DecodeProblem
from .scheduler import MAX_ACC_ROWS_PER_PART, ScheduleTable, batch_num_blocks, schedule
from .workspace import accumulator_bytes, split_accumulators

__all__ = [
    "FlashMLASchedMeta",
    "ScheduleConfig",
    "DecodePlan",
    "get_mla_metadata",
    "plan_decode",
    "ensure_plan",
    "check_plan_belongs",
    "check_sched_meta",
    "decode_workspace_bytes",
    "DEFAULT_CPU_NUM_SMS",
    "MAX_NUM_SMS",
]

#: SM count assumed for CPU tensors (an H800/H100's 132, so CPU runs schedule like them).
DEFAULT_CPU_NUM_SMS = 132
#: Largest ``num_sms`` accepted (partitions get accumulators of ``b + num_sm_parts`` rows).
MAX_NUM_SMS = 1024


@dataclass(frozen=True)
class ScheduleConfig:
    """What a schedule was made for; a call with a different one needs a new scheduler object."""

    b: int
    s_q: int
    h_q: int
    d_qk: int
    topk: int
    has_topk_length: bool
    extra_topk: int
    has_extra_topk_length: bool
    num_sms: int
    device: str
    backend: str  # as requested ("auto" or a name)
    dense: bool = False  # the dense decode (topk: the block table's capacity; lengths: cache_seqlens)

    def differences(self, other: ScheduleConfig) -> str:
        return ", ".join(
            f"{f.name} {getattr(self, f.name)!r} -> {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        )


@dataclass(frozen=True)
class DecodePlan:
    """The backend that runs a decode step, the schedule sized for its tile, and the split-KV
    workspace the schedule needs (``(o_accum, lse_accum)``, ``table.num_acc_rows`` rows; reused
    by every eager call of the step)."""

    backend: Backend
    table: ScheduleTable
    workspace: Workspace
    config: ScheduleConfig | None = None  # what it was made for (:func:`ensure_plan` checks it)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the split-KV workspace (8 when nothing is split: two placeholder floats)."""
        return sum(t.numel() * t.element_size() for t in self.workspace)


@dataclass
class FlashMLASchedMeta:
    """Tile-scheduler state shared by the calls of one decode step (FlashMLA's ``FlashMLASchedMeta``).

    Empty until the first :func:`sparse_mla.flash_mla_with_kvcache` call fills it; later calls
    must have the same :class:`ScheduleConfig`, else ``ValueError``. The *values* of
    ``topk_length``/``extra_topk_length`` may change from call to call (FlashMLA asks for a new
    object then): each call schedules its own lengths on the device.

    The object also holds the split-KV workspace of the step (``workspace_bytes``; at most
    :func:`decode_workspace_bytes`), allocated by the first call and reused by every later eager
    call, so steady-state calls allocate nothing but their outputs (none with ``out=``/``lse=``).
    Calls that share an object must therefore run one after another on one stream (as the layers
    of a decode step do); a call captured in a CUDA graph gets its own workspace from the graph's
    memory pool, so the graph stays valid after the object is dropped.

    Attributes:
        num_sms: SM count to schedule for (None: the device's).
        have_initialized: whether the plan is filled.
        config: the :class:`ScheduleConfig` the plan was made for.
        plan: the :class:`DecodePlan` (backend + schedule on the device).
    """

    num_sms: int | None = None
    have_initialized: bool = False
    config: ScheduleConfig | None = None
    plan: DecodePlan | None = None
    #: the last validated eager call (a :class:`~sparse_mla.decode.eager.CallCache`, or None): a
    #: repeated call with its geometry skips the checks but the out/lse overlap one, and replays
    #: its launches
    call_cache: Any = field(default=None, repr=False, compare=False)

    @property
    def table(self) -> ScheduleTable | None:
        """The :class:`~sparse_mla.decode.scheduler.ScheduleTable` on the device, or None before use."""
        return None if self.plan is None else self.plan.table

    @property
    def backend(self) -> str | None:
        """Name of the backend that runs this step (``"hopper"``, ``"portable"``, ``"reference"``)."""
        return None if self.plan is None else self.plan.backend.name

    @property
    def workspace_bytes(self) -> int:
        """Bytes of split-KV workspace this object holds (0 before use)."""
        return 0 if self.plan is None else self.plan.workspace_bytes

    @property
    def tile_scheduler_metadata(self) -> torch.Tensor | None:
        """``[num_sm_parts, 8]`` int32 (see :mod:`sparse_mla.decode.scheduler`), or None before use."""
        return None if self.table is None else self.table.metadata

    @property
    def num_splits(self) -> torch.Tensor | None:
        """``[b + 1]`` int32 prefix sums of splits per batch, or None before use."""
        return None if self.table is None else self.table.num_splits


def get_mla_metadata(*args: Any, num_sms: int | None = None, **kwargs: Any) -> tuple[FlashMLASchedMeta, None]:
    """Return an empty scheduler object, filled on first use: ``(sched_meta, None)``.

    Positional and other keyword arguments are accepted and ignored, as in FlashMLA 1.0.

    Args:
        num_sms: schedule for this many SMs (1..1024) instead of the device's (tests, what-if studies).

    Raises:
        ValueError: ``num_sms`` is not an int in [1, 1024].
    """
    return FlashMLASchedMeta(num_sms=_checked_num_sms(num_sms)), None


def _checked_num_sms(num_sms: Any) -> int | None:
    """``num_sms`` as an int (NumPy integers too) or None; ValueError outside [1, MAX_NUM_SMS]."""
    if num_sms is None:
        return None
    if isinstance(num_sms, bool) or not isinstance(num_sms, numbers.Integral) or not 0 < num_sms <= MAX_NUM_SMS:
        raise ValueError(f"num_sms: expected an int in [1, {MAX_NUM_SMS}] or None, got {num_sms!r}")
    return int(num_sms)


def _device_num_sms(device: torch.device) -> int:
    return cuda_num_sms(device) if device.type == "cuda" else DEFAULT_CPU_NUM_SMS


def _config_of(p: DecodeProblem, num_sms: int, backend: str) -> ScheduleConfig:
    b, s_q, h_q, d_qk = p.shape
    return ScheduleConfig(
        b=b,
        s_q=s_q,
        h_q=h_q,
        d_qk=d_qk,
        topk=p.topk,
        has_topk_length=p.topk_length is not None,
        extra_topk=p.extra_topk,
        has_extra_topk_length=p.extra_topk_length is not None,
        num_sms=num_sms,
        device=str(p.q.device),
        backend=backend,
        dense=p.is_dense,
    )


def plan_decode(p: DecodeProblem, num_sms: int | None = None, backend: str = "auto") -> DecodePlan:
    """Choose the backend for ``p`` and make its schedule: on the host from the shapes, or, when
    ``p`` has ``topk_length``/``extra_topk_length``, a ``dynamic`` schedule that every call remakes
    on the device from its lengths (:func:`sparse_mla.decode.backends.run_decode`). No host read of
    a tensor's values.

    Args:
        p: a validated problem (not empty).
        num_sms: SMs to schedule for (default: the device's; 132 for CPU tensors).
        backend: ``"auto"`` or a backend name (:mod:`sparse_mla.decode.backends`).
    """
    chosen = resolve_backend(p, backend)
    b, s_q, h_q, _ = p.shape
    num_sms = num_sms or _device_num_sms(p.q.device)
    parts = chosen.num_sm_parts(num_sms, s_q, h_q)
    main, total = batch_num_blocks(b, p.topk, None, p.extra_topk, None)
    full = schedule(total, parts, main_blocks=main)  # every batch at its full topk (and extra_topk)
    if p.topk_length is None and p.extra_topk_length is None:
        table = full.to(p.q.device)
    else:  # made on the device by every call from its own lengths (run_decode)
        table = dynamic_table(b, parts, p.q.device, full.max_pieces)
    workspace = split_accumulators(table.num_acc_rows, s_q, h_q, p.d_v, p.q.device)
    return DecodePlan(chosen, table, workspace, _config_of(p, num_sms, backend))


def decode_workspace_bytes(b: int, s_q: int, h_q: int, num_sms: int | None = None, d_v: int = 512) -> int:
    """The most split-KV workspace bytes a decode step of this shape can need (any backend, any
    ``topk``/``topk_length``): ``rows * s_q * h_q * (d_v + 1) * 4`` with ``rows <= min(2 *
    num_sm_parts, b + num_sm_parts - 1)`` (0 when there is one partition: nothing is split).

    The workspace lives with the scheduler object (``FlashMLASchedMeta.workspace_bytes`` gives
    what one holds). Example (132 SMs, h_q 128): b=128, s_q=2 -> 33 partitions, at most 66 rows,
    34.7 MB (FlashMLA allocates 84.6 MB per call); one request with s_q = 16384 (a mixed batch
    as one request) -> 1 partition, 8 bytes.

    Args:
        b, s_q, h_q: batch, query tokens per request, query heads (h_q 1..128).
        num_sms: SMs scheduled for (default: the current CUDA device's, else 132).
        d_v: value head dim (512).

    Raises:
        ValueError: a non-positive size, ``d_v`` other than 512, ``num_sms`` outside [1, 1024].
    """
    for name, v in (("b", b), ("s_q", s_q), ("h_q", h_q), ("d_v", d_v)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    b, s_q, h_q, d_v = int(b), int(s_q), int(h_q), int(d_v)  # (NumPy integers accepted)
    if h_q > MAX_H_Q:
        raise ValueError(f"h_q: expected at most {MAX_H_Q}, got {h_q}")
    if d_v != 512:
        raise ValueError(f"d_v: expected 512 (the value head dim of both layouts), got {d_v}")
    num_sms = _checked_num_sms(num_sms)
    if num_sms is None:
        num_sms = cuda_num_sms() if torch.cuda.is_available() else DEFAULT_CPU_NUM_SMS
    parts = max(BACKENDS[name].num_sm_parts(num_sms, s_q, h_q) for name in AUTO_ORDER)
    rows = 0 if parts == 1 else min(MAX_ACC_ROWS_PER_PART * parts, b + parts - 1)
    return accumulator_bytes(rows, s_q, h_q, d_v)


def check_sched_meta(meta: Any) -> FlashMLASchedMeta:
    """``meta`` if it is a :class:`FlashMLASchedMeta`, else ``TypeError`` naming ``tile_scheduler_metadata``."""
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(
            f"tile_scheduler_metadata: expected the FlashMLASchedMeta from get_mla_metadata(), got {type(meta).__name__}"
        )
    return meta


def check_plan_belongs(meta: FlashMLASchedMeta) -> None:
    """A filled scheduler object's plan was made for the configuration it records (its public
    fields can be set by hand: a plan taken from another object would run another schedule)."""
    plan = meta.plan
    if meta.config is None or plan is None or plan.config != meta.config:
        raise ValueError(
            "tile_scheduler_metadata: its plan does not belong to the configuration it records (its fields were "
            "set by hand?); call get_mla_metadata() again for a new one"
        )


def ensure_plan(meta: FlashMLASchedMeta, p: DecodeProblem, backend: str = "auto") -> DecodePlan:
    """Fill ``meta`` on its first use; afterwards check that ``p`` has the configuration it was
    filled for and return its plan (no host synchronisation).

    Raises:
        TypeError: ``meta`` is not a :class:`FlashMLASchedMeta`; ``backend`` is not a str.
        ValueError: ``backend`` names no backend; a different configuration than the one ``meta``
            was filled for.
    """
    check_sched_meta(meta)
    if not isinstance(backend, str) or backend != "auto":
        get_backend(backend)  # a non-str or an unknown name is named as such, not as another configuration
    num_sms = meta.num_sms or _device_num_sms(p.q.device)
    cfg = _config_of(p, num_sms, backend)
    if meta.have_initialized:
        check_plan_belongs(meta)
        if meta.config != cfg:
            raise ValueError(
                f"tile_scheduler_metadata: this object was filled for another configuration ({meta.config.differences(cfg)}); "
                "call get_mla_metadata() again for a new one"
            )
        return meta.plan
    meta.plan = plan_decode(p, num_sms, backend)
    meta.config, meta.have_initialized = cfg, True
    return meta.plan
