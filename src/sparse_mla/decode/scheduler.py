"""Tile scheduler of the split-KV sparse decode (walkthrough step 3, docs/design.md §5).

The work of batch ``i`` is ``num_blocks[i] = ceil(max(topk_eff_i, 1) / 64)`` blocks of 64 top-k
indices (plus ``ceil(extra_topk_eff_i / 64)`` blocks of the extra cache), and each batch a
partition touches costs a fixed overhead of 5 blocks (loading q, initialising the softmax
state, writing the result). ``num_sm_parts`` partitions, each worth
``ceil(total / num_sm_parts) + 5``, are filled greedily from left to right; a batch that does
not fit is split across partitions, and its partial results are merged by the combine step.

Each partition is one row of ``tile_scheduler_metadata`` (int32, :data:`META_FIELDS` columns)::

    begin_req, end_req            first and last batch (inclusive) the partition touches
    begin_block, end_block        first block of begin_req, end block (exclusive) of end_req
    begin_split                   split index of the begin_req piece inside that batch
    is_first_req_splitted         begin_req started in an earlier partition
    is_last_req_splitted          end_req continues in a later partition
    (pad)

An idle partition has ``begin_req = b`` (> ``end_req``). ``num_splits`` is the prefix sum
``[0, n_0, n_0 + n_1, ...]`` of the number of pieces of every batch: batch ``i``'s partial
results are merged by the combine step.

The fp32 split accumulators hold rows for split batches only: ``acc_rows`` is the prefix sum of
``n_i`` over batches with ``n_i > 1`` pieces (0 for the others), so batch ``i``'s partial results
live at rows ``acc_rows[i] .. acc_rows[i+1]-1`` and the accumulators need ``acc_rows[b]`` rows,
at most ``2 * num_sm_parts`` whatever ``b`` and ``s_q`` (a partition holds at most two pieces of
split batches: its first and its last): :data:`MAX_ACC_ROWS_PER_PART`.

**Schedules that follow ``topk_length``.** Without ``topk_length``/``extra_topk_length`` every
batch has the same work and the schedule above depends only on the shapes: it is made once, on the
host. With lengths the work of each batch is only known on the device, and it changes from step to
step; the schedule is then made on the device by every call, in the same stream order as the
kernels that read it (:func:`schedule_from_lengths` is the PyTorch twin of the Triton kernel
:mod:`sparse_mla.decode.kernels.schedule`): no host synchronisation, the same in a CUDA graph,
right whatever the lengths of the step. Its partition is computed per partition in parallel: the
batches' costs ``n_i + 5`` laid end to end form a line of length ``T``; partition ``p`` takes
the blocks whose positions lie in ``[p * P, (p + 1) * P)`` with ``P = ceil(T / num_sm_parts)``
(block ``k`` of batch ``i`` sits at ``C_i + 5 + k``, ``C_i`` the cost of the batches before it),
so it does at most ``P + 5`` blocks of work, the bound of the greedy fill. A partition whose
range holds only a batch's overhead is idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.target import pdl_enabled

__all__ = [
    "TOPK_BLOCK_SIZE",
    "FIXED_OVERHEAD_NUM_BLOCKS",
    "META_FIELDS",
    "MAX_ACC_ROWS_PER_PART",
    "ScheduleTable",
    "compute_num_sm_parts",
    "small_head_tile",
    "hopper_head_tile",
    "batch_num_blocks",
    "schedule",
    "length_block_counts",
    "schedule_from_lengths",
    "dynamic_acc_rows",
]

TOPK_BLOCK_SIZE = 64
FIXED_OVERHEAD_NUM_BLOCKS = 5
META_FIELDS = (
    "begin_req",
    "end_req",
    "begin_block",
    "end_block",
    "begin_split",
    "is_first_req_splitted",
    "is_last_req_splitted",
    "pad",
)


#: accumulator rows per partition at most (its first and its last piece may belong to split batches)
MAX_ACC_ROWS_PER_PART = 2


def compute_num_sm_parts(num_sms: int, s_q: int, h_q: int, heads_per_cta: int = 64) -> int:
    """Partitions per query token: ``max(num_sms // s_q // ceil(h_q / heads_per_cta), 1)``.

    A partition runs ``ceil(h_q / heads_per_cta)`` programs for each of the ``s_q`` query tokens,
    so ``num_sm_parts * s_q * ceil(h_q / heads_per_cta)`` programs about fill ``num_sms`` SMs.
    Seed: 132 SMs, s_q = 1, h_q = 128, 64 heads per CTA -> 66.
    """
    for name, v in (("num_sms", num_sms), ("s_q", s_q), ("h_q", h_q), ("heads_per_cta", heads_per_cta)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return max(num_sms // s_q // (-(-h_q // heads_per_cta)), 1)


def small_head_tile(h_q: int) -> int:
    """Heads per program of the portable kernel (and the reference that mirrors its schedule):
    16 when that is all there is, else 64 (FlashMLA's tile; on the H200 a 32-head tile ran
    slower than a 64-head one)."""
    return 16 if h_q <= 16 else 64


def hopper_head_tile(h_q: int) -> int:
    """Heads per CTA of the Hopper decode kernel: 16 or 32 when that is all there is (its narrow
    consumer puts the heads on the wgmma's N and a block's 64 tokens on M), else 64 (one wgmma M
    tile; rows past h_q are zero queries, never stored).

    The thresholds are the measured crossover (H200, V32, s_q 2, topk 2048, graph replay,
    2026-12-03, commit b4e0104): the 16-head tile 145.1 µs at b=128 where the 32-head tile takes 204.3; the
    32-head tile 204.3 / 109.0 / 23.2 µs at b = 128 / 64 / 2 against 247.8 / 131.2 / 26.2 for the
    64-head tile; past 32 heads one 64-head tile (247.8) against two 32-head tiles' ~2 x 204."""
    return 16 if h_q <= 16 else 32 if h_q <= 32 else 64


def batch_num_blocks(
    b: int,
    topk: int,
    topk_length: Sequence[int] | None = None,
    extra_topk: int = 0,
    extra_topk_length: Sequence[int] | None = None,
    block_size: int = TOPK_BLOCK_SIZE,
) -> tuple[list[int], list[int]]:
    """Blocks of work per batch: ``(main_blocks, total_blocks)``.

    ``main_blocks[i] = ceil(min(topk_length[i], topk) / block_size)`` (blocks over the main
    cache's indices), followed by ``ceil(extra_len / block_size)`` blocks over the extra cache;
    a batch with nothing to attend still counts one (empty) block, so it writes out = 0 and
    lse = +inf.
    """
    main, total = [], []
    for i in range(b):
        n = topk if topk_length is None else max(0, min(int(topk_length[i]), topk))
        e = extra_topk if extra_topk_length is None else max(0, min(int(extra_topk_length[i]), extra_topk))
        mb = -(-n // block_size)
        tb = mb + (-(-e // block_size))
        main.append(mb)
        total.append(max(tb, 1))
    return main, total


@dataclass
class ScheduleTable:
    """The scheduler's output on the host (lists) and as device tensors.

    Attributes:
        num_sm_parts: number of partitions (rows of ``metadata``).
        metadata: ``[num_sm_parts, 8]`` int32, columns :data:`META_FIELDS`.
        num_splits: ``[b + 1]`` int32 prefix sums of pieces per batch.
        main_blocks: ``[b]`` int32 blocks over the main cache per batch.
        num_blocks: per-batch total blocks (host list).
        payload: capacity of one partition in blocks (overhead included).
        num_blocks_t: ``[b]`` int32, ``num_blocks`` as a tensor (read by the kernels).
        acc_rows: ``[b + 1]`` int32 prefix sums of accumulator rows per batch (``n_i`` pieces for a
            split batch, 0 for the others).
        num_acc_rows: ``acc_rows[b]``, the accumulator rows the step needs (0 when nothing is split).
        max_pieces: the most pieces of one batch (how many rows the combine merges at most per batch;
            0: not known; for a ``dynamic`` table an estimate, a hint only).
        dynamic: made on the device from ``topk_length``/``extra_topk_length`` by every call
            (:func:`schedule_from_lengths`): ``num_blocks`` is then empty and ``payload`` 0 (known
            on the device only), and ``num_acc_rows`` is the bound :func:`dynamic_acc_rows`.
        split_list: (``dynamic`` tables) ``[num_sm_parts + 1]`` int32: the number of split batches,
            then those batches in order (entries past the count are not meaningful). Each split
            batch holds one of the ``num_sm_parts - 1`` partition boundaries, so at most that many:
            the combine runs ``num_sm_parts`` programs a head/column tile over this list, not one
            per batch.
    """

    num_sm_parts: int
    metadata: torch.Tensor
    num_splits: torch.Tensor
    main_blocks: torch.Tensor
    num_blocks: list[int]
    payload: int
    num_blocks_t: torch.Tensor
    acc_rows: torch.Tensor
    num_acc_rows: int
    max_pieces: int = 0
    dynamic: bool = False
    split_list: torch.Tensor | None = None

    def decode_waits_for_it(self, device: torch.device) -> bool:
        """Whether the decode kernel is launched as the programmatic dependent of the kernel that
        made this table just before (a ``dynamic`` table, where the target has PDL): it then waits
        (``griddepcontrol.wait``) for that grid before reading the table."""
        return self.dynamic and pdl_enabled(device)

    @property
    def any_split(self) -> bool:
        """Whether some batch has more than one piece (its rows need the combine step)."""
        return self.num_acc_rows > 0

    def rows(self) -> list[dict[str, int]]:
        """The metadata as a list of dicts (for printing and tests)."""
        return [dict(zip(META_FIELDS, map(int, r), strict=True)) for r in self.metadata.tolist()]

    def to(self, device: torch.device) -> ScheduleTable:
        return ScheduleTable(
            self.num_sm_parts,
            self.metadata.to(device),
            self.num_splits.to(device),
            self.main_blocks.to(device),
            self.num_blocks,
            self.payload,
            self.num_blocks_t.to(device),
            self.acc_rows.to(device),
            self.num_acc_rows,
            self.max_pieces,
            self.dynamic,
            None if self.split_list is None else self.split_list.to(device),
        )


def schedule(
    num_blocks: Sequence[int],
    num_sm_parts: int,
    fixed_overhead: int = FIXED_OVERHEAD_NUM_BLOCKS,
    main_blocks: Sequence[int] | None = None,
) -> ScheduleTable:
    """Greedy left-to-right partition of ``num_blocks`` over ``num_sm_parts`` (host side, exact).

    Args:
        num_blocks: blocks of work per batch (each >= 1).
        num_sm_parts: partitions to fill (>= 1).
        fixed_overhead: cost of touching one batch, in blocks (5 as in FlashMLA).
        main_blocks: blocks over the main cache per batch (defaults to ``num_blocks``).

    Returns:
        :class:`ScheduleTable` on the CPU.

    Raises:
        ValueError: ``num_blocks`` contains a value < 1 or ``num_sm_parts`` < 1.
    """
    b = len(num_blocks)
    if num_sm_parts < 1:
        raise ValueError(f"num_sm_parts: expected >= 1, got {num_sm_parts}")
    if any(int(n) < 1 for n in num_blocks):
        raise ValueError("num_blocks: every batch needs at least one block")
    total = sum(int(n) + fixed_overhead for n in num_blocks)
    payload = -(-total // num_sm_parts) + fixed_overhead
    meta = []
    prefix = [0] * (b + 1)
    cum = 0
    req, blk, split = 0, 0, 0
    for _ in range(num_sm_parts):
        begin_req, begin_block, begin_split = req, blk, split
        first_splitted = int(blk > 0)
        remain = payload
        while req < b:
            need = int(num_blocks[req]) - blk + fixed_overhead
            if need <= remain:
                remain -= need
                cum += split + 1
                prefix[req + 1] = cum
                req, blk, split = req + 1, 0, 0
            else:
                take = remain - fixed_overhead
                if take > 0:
                    blk += take
                    split += 1
                break
        if req >= b and begin_req >= b:
            meta.append([b, b - 1, 0, 0, 0, 0, 0, 0])  # idle
            continue
        if blk > 0 and (req > begin_req or blk > begin_block):
            end_req, end_block, last_splitted = req, blk, 1
        else:
            end_req = req - 1
            end_block = int(num_blocks[end_req])
            last_splitted = 0
        if end_req < begin_req:  # could not take even one block (cannot happen with payload >= overhead + 1)
            meta.append([b, b - 1, 0, 0, 0, 0, 0, 0])
            continue
        meta.append([begin_req, end_req, begin_block, end_block, begin_split, first_splitted, last_splitted, 0])
    if req < b:
        raise RuntimeError("scheduler: work left after the last partition (internal error)")
    mb = list(num_blocks) if main_blocks is None else list(main_blocks)
    acc = [0]
    for i in range(b):
        n = prefix[i + 1] - prefix[i]
        acc.append(acc[-1] + (n if n > 1 else 0))
    return ScheduleTable(
        num_sm_parts=num_sm_parts,
        metadata=torch.tensor(meta, dtype=torch.int32).view(num_sm_parts, len(META_FIELDS)),
        num_splits=torch.tensor(prefix, dtype=torch.int32),
        main_blocks=torch.tensor(mb, dtype=torch.int32),
        num_blocks=[int(n) for n in num_blocks],
        payload=payload,
        num_blocks_t=torch.tensor([int(n) for n in num_blocks], dtype=torch.int32),
        acc_rows=torch.tensor(acc, dtype=torch.int32),
        num_acc_rows=acc[-1],
        max_pieces=max(prefix[i + 1] - prefix[i] for i in range(b)) if b else 1,
    )


def dynamic_acc_rows(b: int, num_sm_parts: int) -> int:
    """Accumulator rows a schedule made from lengths can need at most: ``min(2 * num_sm_parts,
    b + num_sm_parts - 1)``, 0 for one partition (nothing is ever split)."""
    return 0 if num_sm_parts == 1 else min(MAX_ACC_ROWS_PER_PART * num_sm_parts, b + num_sm_parts - 1)


def length_block_counts(
    b: int,
    topk: int,
    topk_length: torch.Tensor | None,
    extra_topk: int = 0,
    extra_topk_length: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`batch_num_blocks` on tensors (no host read): ``(main_blocks, num_blocks)`` int64 ``[b]``."""
    dev = device if topk_length is None else topk_length.device
    if topk_length is None:
        main = torch.full((b,), -(-topk // TOPK_BLOCK_SIZE), dtype=torch.int64, device=dev)
    else:
        main = (topk_length.long().clamp(0, topk) + TOPK_BLOCK_SIZE - 1) // TOPK_BLOCK_SIZE
    if extra_topk_length is None:
        extra = torch.full_like(main, -(-extra_topk // TOPK_BLOCK_SIZE))
    else:
        extra = (extra_topk_length.long().clamp(0, extra_topk) + TOPK_BLOCK_SIZE - 1) // TOPK_BLOCK_SIZE
    return main, (main + extra).clamp(min=1)


def schedule_from_lengths(
    main_blocks: torch.Tensor,
    num_blocks: torch.Tensor,
    num_sm_parts: int,
    fixed_overhead: int = FIXED_OVERHEAD_NUM_BLOCKS,
    max_pieces: int = 0,
) -> ScheduleTable:
    """The schedule made on the device (module docstring), in PyTorch: the twin of
    :func:`sparse_mla.decode.kernels.schedule.schedule_fwd`, on the tensors' device, no host read.

    Args:
        main_blocks, num_blocks: ``[b]`` integer block counts (:func:`length_block_counts`),
            ``num_blocks >= 1``.
        num_sm_parts: partitions (>= 1).
        fixed_overhead: cost of touching one batch, in blocks.
        max_pieces: the hint the table carries (:attr:`ScheduleTable.max_pieces`).

    Returns:
        a ``dynamic`` :class:`ScheduleTable` with ``num_acc_rows = dynamic_acc_rows(b, num_sm_parts)``.
    """
    b = num_blocks.shape[0]
    dev = num_blocks.device
    n = num_blocks.long()
    cost = n + fixed_overhead
    c_next = torch.cumsum(cost, 0)
    c = c_next - cost
    total = c_next[-1]
    cap = (total + num_sm_parts - 1) // num_sm_parts
    # batches of one cost that fit whole in the host scheduler's payload (cap + overhead): a
    # partition takes a whole number of them, as :func:`schedule` does, instead of splitting
    whole = (cap + cost.max() - 1) // cost.max() * cost.max()
    cap = torch.where((cost.min() == cost.max()) & (whole <= cap + fixed_overhead), whole, cap)
    start = torch.arange(num_sm_parts, device=dev) * cap
    end = torch.minimum(start + cap, total)
    # the batch whose cost span holds the start, and the last one whose blocks begin before the end
    first = torch.searchsorted(c_next, start, right=True)
    last = torch.searchsorted(c + fixed_overhead, end) - 1
    busy = (first <= last) & (start < total)
    fi, la = first.clamp(max=b - 1), last.clamp(min=0)
    begin_block = (start - c[fi] - fixed_overhead).clamp(min=0)
    end_block = torch.minimum(n[la], end - c[la] - fixed_overhead)
    # the piece of the first batch this is: the partitions before it that hold some of its blocks
    begin_split = torch.arange(num_sm_parts, device=dev) - (c[fi] + fixed_overhead) // cap
    idle = torch.tensor([b, b - 1, 0, 0, 0, 0, 0, 0], device=dev)
    rows = torch.stack(
        [fi, la, begin_block, end_block, begin_split, (begin_split > 0).long(), (end_block < n[la]).long(),
         torch.zeros_like(fi)], dim=1,
    )  # fmt: skip
    meta = torch.where(busy[:, None], rows, idle)
    pieces = (c_next - 1) // cap - (c + fixed_overhead) // cap + 1
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    num_splits = torch.cat([zero, torch.cumsum(pieces, 0)])
    acc_rows = torch.cat([zero, torch.cumsum(torch.where(pieces > 1, pieces, 0), 0)])
    split = pieces > 1
    # [count, split batches...]: batch i at 1 + its rank among the split ones (the rest to a dropped slot)
    slot = torch.where(split, torch.cumsum(split, 0), num_sm_parts + 1).clamp(max=num_sm_parts + 1)
    listed = torch.zeros(num_sm_parts + 2, dtype=torch.int64, device=dev)
    listed.scatter_(0, slot, torch.arange(b, device=dev))
    listed[0] = split.sum()
    i32 = torch.int32
    return ScheduleTable(
        num_sm_parts=num_sm_parts,
        metadata=meta.to(i32).contiguous(),
        num_splits=num_splits.to(i32),
        main_blocks=main_blocks.to(i32).contiguous(),
        num_blocks=[],
        payload=0,
        num_blocks_t=num_blocks.to(i32).contiguous(),
        acc_rows=acc_rows.to(i32),
        num_acc_rows=dynamic_acc_rows(b, num_sm_parts),
        max_pieces=max_pieces,
        dynamic=True,
        split_list=listed[: num_sm_parts + 1].to(i32),
    )
