"""Host side of the Hopper kernel: the argument tuples, the compile-time switches, the grid and the
launch (with the combine when some batch is split)."""

from __future__ import annotations

import torch

from ....core.env import LOG2E
from ....core.launcher import carveout_hint
from ....core.launcher import launch as launch_kernel
from ....formats import cache_bytes
from ...problem import DecodeProblem, output_tensors
from ...scheduler import TOPK_BLOCK_SIZE, ScheduleTable, hopper_head_tile
from ...workspace import split_accumulators
from ..combine import combine_fwd
from .config import (
    BLOCK_H,
    BLOCK_N,
    CONSUMER_WARPS,
    HopperConfig,
    resolve_half_stages,
    resolve_narrow_rowsum,
    resolve_narrow_staged_out,
)
from .kernel import _sparse_decode_gluon_kernel

__all__ = ["launch"]


def record_alignment(raw: torch.Tensor, is_v32: bool, extra: torch.Tensor | None) -> int:
    """The largest power of two (at most 16) that divides every token record's byte address in the
    caches: the gathers are 16-byte loads when it is 16 (every FlashMLA layout), narrower for views
    whose block or token stride is not (a dense copy of a padded MODEL1 cache: 61 * 584 bytes)."""
    vals = [raw.data_ptr(), raw.stride(0), raw.stride(1) if is_v32 else 576]
    if extra is not None:
        x = cache_bytes(extra)
        vals += [x.data_ptr(), x.stride(0), x.stride(1) if is_v32 else 576]
    a = 16
    for v in vals:
        while v % a:
            a //= 2
    return a


def rows_alignment(kv: torch.Tensor) -> int:
    """``ALIGN`` of bf16 rows (``KV_BF16``): the largest power of two (at most 16) that divides every
    row's byte address as Triton can know it: 2 when the base pointer is not 16-byte aligned
    (Triton specialises a pointer on 16-byte alignment only), else what the row stride allows."""
    if kv.data_ptr() % 16:
        return 2
    v, a = kv.stride(0) * kv.element_size(), 16
    while v % a:
        a //= 2
    return a


def launch(
    p: DecodeProblem,
    table: ScheduleTable,
    config: HopperConfig,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the warp-specialised kernel, and the combine kernel when some batch is split.

    Args:
        p: a validated, non-empty problem on an sm_90 device (the dispatcher checks,
            :mod:`sparse_mla.decode.backends`); its ``k_cache`` may also be bf16 rows
            ``[s_kv, 1, d_qk]`` (the sparse prefill's ``kv``, :mod:`sparse_mla.prefill.kernels.hopper`;
            no extra cache), indexed by row.
        table: its schedule on ``p.q``'s device, sized for 64-head tiles.
        config: launch parameters.
        workspace: ``(o_accum, lse_accum)`` of at least ``table.num_acc_rows`` rows
            (:func:`sparse_mla.decode.workspace.split_accumulators`), or None to allocate them.
        max_logits: ``[b, h_q]`` fp32 (any strides) to also receive each row's largest
            ``q·k·sm_scale`` (-inf for a row with no valid key), or None. Only for ``s_q = 1``
            and a schedule of one whole request a partition (the sparse prefill's,
            :func:`sparse_mla.prefill.kernels.hopper.prefill_table`): the consumers then store O through
            the request's staged Q tile, which a second request in the partition would overwrite.

    Returns:
        ``out [b, s_q, h_q, 512]`` bf16, ``lse [b, h_q, s_q]`` fp32.
    """
    q = p.q
    b, s_q, h_q, _ = q.shape
    assert TOPK_BLOCK_SIZE == BLOCK_N and p.layout.name in ("V32", "MODEL1")
    is_v32 = p.layout.name == "V32"
    dev = q.device
    out, lse = output_tensors(p)
    o_acc, l_acc = workspace or split_accumulators(table.num_acc_rows, s_q, h_q, p.d_v, dev)
    prefill = max_logits is not None
    if prefill:
        assert s_q == 1 and not table.any_split and table.num_sm_parts == b, (
            "max_logits: only for s_q = 1 and one whole request a partition"
        )
        ml = (max_logits, max_logits.stride(0), max_logits.stride(1))
    else:
        ml = (l_acc, 0, 0)  # never written
    kv_bf16 = p.k_cache.dtype == torch.bfloat16
    if kv_bf16:  # rows [s_kv, 1, d_qk]: (pointer, row stride, -, s_kv, -)
        assert p.extra_k_cache is None, "bf16 rows: no extra cache"
        rows = p.k_cache if p.k_cache.shape[0] else q  # s_kv = 0: every index is invalid, nothing is read
        pbs = 1
        cache = (rows, rows.stride(0), 0, p.k_cache.shape[0], 1)
        align = rows_alignment(rows)
    else:
        raw = cache_bytes(p.k_cache)
        pbs = raw.shape[1]
        cache = (raw, raw.stride(0), raw.stride(1) if is_v32 else 576, raw.shape[0] * pbs, pbs)
        align = record_alignment(raw, is_v32, p.extra_k_cache)
    pow2 = pbs & (pbs - 1) == 0
    dummy_i32 = table.acc_rows
    idx = p.indices
    sel = (idx, *idx.stride(), idx.shape[2], p.topk_length if p.topk_length is not None else dummy_i32)
    if p.extra_k_cache is not None:
        xraw = cache_bytes(p.extra_k_cache)
        xi = p.extra_indices
        xcache = (xraw, xraw.stride(0), xraw.shape[0] * xraw.shape[1], xraw.shape[1])
        xlen = p.extra_topk_length if p.extra_topk_length is not None else dummy_i32
        xsel = (xi, *xi.stride(), xi.shape[2], xlen)
    else:  # placeholders (never read)
        xcache = (cache[0], 0, 0, 1)
        xsel = (dummy_i32, 0, 0, 0, 0, dummy_i32)
    heads = hopper_head_tile(h_q)
    narrow = heads < BLOCK_H
    if heads == 16:
        pw, preg, maxnreg = config.narrow16_producer_warps, config.narrow16_producer_regs, config.narrow16_maxnreg
    else:
        pw = config.narrow_producer_warps if narrow else config.producer_warps
        preg, maxnreg = config.producer_regs, config.maxnreg
    grid = (table.num_sm_parts, s_q, -(-h_q // heads))
    wait_prior = table.decode_waits_for_it(q.device)  # overlap this launch with the schedule kernel
    args = (
        (q, *q.stride()[:3]),
        cache,
        sel,
        xcache,
        xsel,
        p.attn_sink if p.attn_sink is not None else l_acc,
        (table.metadata, table.acc_rows, table.main_blocks, table.num_blocks_t),
        (out, *out.stride()[:3]),
        (lse, *lse.stride()[:3]),
        (o_acc, *o_acc.stride()[:3]),
        (l_acc, *l_acc.stride()[:2]),
        ml,
        p.sm_scale * LOG2E,
        h_q,
    )
    consts = dict(
        KV_BF16=kv_bf16,
        IS_V32=is_v32,
        HAS_TOPK_LEN=p.topk_length is not None,
        HAS_EXTRA=p.extra_k_cache is not None,
        HAS_EXTRA_LEN=p.extra_topk_length is not None,
        HAS_SINK=p.attn_sink is not None,
        HAS_MAX_LOGITS=prefill,
        PBS_POW2=pow2,
        PBS_LOG2=pbs.bit_length() - 1 if pow2 else 0,
        ALIGN=align,
        PRODUCER_WARPS=pw,
        PRODUCER_REGS=preg,
        HEADS=heads,
        PV_REGS=config.pv_regs,
        HALF_STAGES=resolve_half_stages(config.half_stages, heads, is_v32, kv_bf16, prefill),
        NARROW_ROWSUM=resolve_narrow_rowsum(config.narrow_rowsum, heads, is_v32),
        NARROW_STAGED=resolve_narrow_staged_out(config.narrow_staged_out, heads, kv_bf16, prefill),
        WAIT_PRIOR=wait_prior,
    )
    options = {"num_warps": CONSUMER_WARPS, "maxnreg": maxnreg, **({"launch_pdl": True} if wait_prior else {})}
    # the carveout hint, set before the first launch too (a graph captured at the first call keeps it)
    launch_kernel(_sparse_decode_gluon_kernel, grid, args, consts, options, carveout_hint(config.smem_carveout))
    if table.any_split:
        combine_fwd(
            o_acc, l_acc, table.acc_rows, out, lse, p.attn_sink, max_pieces=table.max_pieces, pdl=True,
            split_list=table.split_list,
        )  # fmt: skip
    return out, lse
