"""The sparse prefill on Hopper, from either ``kv`` form: the decode's warp-specialised Gluon
kernel (:mod:`sparse_mla.decode.kernels.hopper`) run with every query token as its own request.

A prefill call ``q [s_q, h_q, d_qk]``, ``indices [s_q, 1, topk]`` (cache slots, or rows of bf16
``kv``) is a decode call with ``b = s_q`` requests of one query token each (``q.unsqueeze(1)``;
the indices already have the decode's ``[b, s_q, topk]`` shape): on the FP8 paged cache the
kernel's cache producer gathers and dequantises, on bf16 rows ``[s_kv, 1, d_qk]`` its
``KV_BF16`` producer copies the rows into the K stages with ``cp.async`` (an index ``< 0`` or
``>= s_kv`` is invalid, as in the other backends). Both run under a schedule of one partition
per query token that splits nothing: each CTA walks the ``ceil(topk / 64)`` blocks of its token for 64 heads and writes
``out``, ``lse`` and ``max_logits`` (the kernel's ``HAS_MAX_LOGITS`` epilogue) directly; no
combine, no workspace. ``topk_length`` masks indices inside the kernel (the block count is taken
from ``topk``, so no device value is read on the host and the call is CUDA-graph safe).
Twin: :func:`sparse_mla.prefill.reference.sparse_prefill_reference`.
"""

from __future__ import annotations

import torch

from ...decode.kernels.hopper import launch as decode_launch
from ...decode.problem import DecodeProblem
from ...decode.scheduler import TOPK_BLOCK_SIZE, ScheduleTable
from ..problem import PrefillProblem

__all__ = ["launch", "prefill_table"]

_TABLES: dict[tuple, ScheduleTable] = {}
_MAX_TABLES = 64


def prefill_table(s_q: int, topk: int, device: torch.device) -> ScheduleTable:
    """One partition per query token, each over all ``ceil(topk / 64)`` blocks of its token,
    nothing split (built on ``device`` without a host sync; remembered per shape, except when
    built during CUDA-graph capture: its values are then only written when the graph replays)."""
    key = (s_q, topk, device)
    t = _TABLES.get(key)
    if t is not None:
        return t
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    nb = max(-(-topk // TOPK_BLOCK_SIZE), 1)
    i32 = dict(dtype=torch.int32, device=device)
    req = torch.arange(s_q, **i32)
    meta = torch.zeros(s_q, 8, **i32)
    meta[:, 0] = req
    meta[:, 1] = req
    meta[:, 3] = nb
    blocks = torch.full((s_q,), nb, **i32)
    t = ScheduleTable(
        num_sm_parts=s_q,
        metadata=meta,
        num_splits=torch.arange(s_q + 1, **i32),
        main_blocks=blocks,
        num_blocks=[nb] * s_q,
        payload=nb,
        num_blocks_t=blocks,
        acc_rows=torch.zeros(s_q + 1, **i32),
        num_acc_rows=0,
        max_pieces=1,
    )
    if capturing:
        return t
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.clear()
    _TABLES[key] = t
    return t


def launch(p: PrefillProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run a validated, non-empty prefill (``kv`` the FP8 paged cache or bf16 rows) on an sm_90 GPU.

    Returns:
        ``out [s_q, h_q, 512]`` bf16, ``max_logits [s_q, h_q]`` fp32, ``lse [s_q, h_q]`` fp32.
    """
    q = p.q
    s_q, h_q, _ = q.shape
    out = q.new_empty((s_q, h_q, p.d_v))
    lse = q.new_empty((s_q, h_q), dtype=torch.float32)
    max_logits = torch.empty_like(lse)
    dp = DecodeProblem(
        q=q.unsqueeze(1),
        k_cache=p.kv,
        indices=p.indices,
        layout=p.layout,
        sm_scale=p.sm_scale,
        d_v=p.d_v,
        topk_length=p.topk_length,
        attn_sink=p.attn_sink,
        out=out.unsqueeze(1),
        lse=lse.unsqueeze(2),
    )
    decode_launch(dp, prefill_table(s_q, p.indices.shape[2], q.device), max_logits=max_logits)
    return out, max_logits, lse
