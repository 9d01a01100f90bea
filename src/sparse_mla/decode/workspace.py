"""The split-KV workspace: the fp32 partial-result buffers the decode kernels write for split
batches and the combine reads (no Triton here: the plan allocates them when it is made).

Rows: the scheduler's ``acc_rows`` prefix (:class:`sparse_mla.decode.scheduler.ScheduleTable`) gives
batch ``i`` rows ``acc_rows[i] .. acc_rows[i+1]-1`` when it is split, none otherwise.
"""

from __future__ import annotations

import torch

__all__ = ["split_accumulators", "accumulator_bytes"]


def split_accumulators(
    rows: int, s_q: int, h_q: int, d_v: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``o_accum [rows, s_q, h_q, d_v]`` and ``lse_accum [rows, s_q, h_q]`` fp32 (uninitialised),
    ``rows`` being the schedule's ``num_acc_rows``; 1-element placeholders when ``rows == 0`` (no
    batch is split: the kernels then never write them)."""
    shape = (rows, s_q, h_q, d_v) if rows > 0 else (1, 1, 1, 1)
    o_acc = torch.empty(shape, dtype=torch.float32, device=device)
    l_acc = torch.empty(shape[:3], dtype=torch.float32, device=device)
    return o_acc, l_acc


def accumulator_bytes(rows: int, s_q: int, h_q: int, d_v: int = 512) -> int:
    """Bytes of :func:`split_accumulators` for ``rows`` rows (8 for the placeholders of 0 rows)."""
    return 4 * rows * s_q * h_q * (d_v + 1) if rows > 0 else 8
