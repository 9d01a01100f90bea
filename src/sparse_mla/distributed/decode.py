"""Context-parallel sparse decode: the cache's slots are spread over the ranks of a process group,
each rank attends the indices it owns, and one all-gather merges the parts.

**Ownership rule: contiguous slot ranges.** ``slot_offsets`` (``world_size + 1`` non-decreasing
ints, ``slot_offsets[0] = 0``) gives rank ``r`` the global slots ``[slot_offsets[r],
slot_offsets[r + 1])``; its ``k_cache`` shard holds global slot ``g`` at local slot ``g -
slot_offsets[r]`` (so a rank that owns whole page blocks ``[B_r, B_{r+1})`` of a global cache uses
``slot_offsets[r] = B_r * page_block_size`` and its shard is those blocks). ``indices`` hold
global slots (``-1`` / out of range: invalid), the same on every rank.

Each rank: indices it does not own (and positions past ``topk_length``) become ``-1``; the local
:func:`sparse_mla.flash_mla_with_kvcache` runs without the sink; ``(out, lse)`` of every rank are
all-gathered in one collective (fp32 ``[b, s_q, h_q, 512 + 1]``); :func:`.merge_attention_states`
merges them by natural-log LSE; ``attn_sink`` is applied once to the merged result. Every rank
returns the same ``(out bf16 [b, s_q, h_q, 512], lse fp32 [b, h_q, s_q])``, equal (to rounding) to a
single device holding the whole cache: lonely queries (no valid key on any rank) get out 0, lse +inf.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..api import flash_mla_with_kvcache
from ..core.checks import check_vector
from ..decode.plan import FlashMLASchedMeta, get_mla_metadata
from .merge import merge_attention_states

__all__ = ["sparse_decode_context_parallel", "localize_indices"]


def localize_indices(indices: torch.Tensor, lo: int, hi: int, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """Global slot ids -> this rank's local ids: ``g - lo`` for ``lo <= g < hi`` (and a position
    below ``topk_length[i]``), ``-1`` otherwise. ``indices [b, s_q, topk]`` int32."""
    g = indices.long()
    own = (g >= lo) & (g < hi)
    if topk_length is not None:
        pos = torch.arange(indices.shape[-1], device=indices.device)
        own &= pos.view(1, 1, -1) < topk_length.long().view(-1, 1, 1)
    return torch.where(own, g - lo, torch.full_like(g, -1)).to(torch.int32)


def _check_offsets(slot_offsets: Any, world: int) -> list[int]:
    if isinstance(slot_offsets, torch.Tensor):
        slot_offsets = slot_offsets.tolist()
    if not isinstance(slot_offsets, Sequence) or len(slot_offsets) != world + 1:
        raise ValueError(f"slot_offsets: expected {world + 1} ints (world_size + 1), got {slot_offsets!r}")
    vals = []
    for v in slot_offsets:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"slot_offsets: expected ints, got {type(v).__name__}")
        vals.append(int(v))
    if vals[0] != 0 or any(vals[i + 1] < vals[i] for i in range(world)):
        raise ValueError(f"slot_offsets: expected non-decreasing ints starting at 0, got {vals}")
    return vals


#: the consistency record's fields before the slot offsets: ok, b, s_q, h_q, d_qk, topk, sink, topk_length
_SIG_FIXED = 8


def _local_part(
    q,
    k_cache,
    indices,
    slot_offsets,
    world,
    rank,
    head_dim_v,
    softmax_scale,
    attn_sink,
    topk_length,
    meta,
    backend,
    sig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's checks and local decode; fills ``sig`` (the record the ranks compare)."""
    offsets = _check_offsets(slot_offsets, world)
    lo, hi = offsets[rank], offsets[rank + 1]
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise TypeError("q: expected a bf16 tensor [b, s_q, h_q, d_qk]")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise TypeError("k_cache: expected this rank's FP8 cache shard [num_blocks, page_block_size, 1, bytes]")
    if k_cache.shape[0] * k_cache.shape[1] < hi - lo:
        raise ValueError(
            f"k_cache: this rank owns {hi - lo} slots but its shard holds {k_cache.shape[0] * k_cache.shape[1]}"
        )
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or indices.dim() != 3:
        raise TypeError("indices: expected an int32 tensor [b, s_q, topk] of global slots")
    # checked as the decode checks them (the local decode gets neither: the lengths cut the global
    # indices, the sink is applied after the merge)
    topk_length = check_vector(topk_length, "topk_length", torch.int32, indices.shape[0], "b", q.device)
    attn_sink = check_vector(attn_sink, "attn_sink", torch.float32, q.shape[2], "h_q", q.device)
    local = localize_indices(indices, lo, hi, topk_length)
    meta = meta if meta is not None else get_mla_metadata()[0]
    out, lse = flash_mla_with_kvcache(
        q, k_cache, None, None, head_dim_v, meta, softmax_scale=softmax_scale, is_fp8_kvcache=True,
        indices=local, backend=backend,
    )  # fmt: skip
    sig[:_SIG_FIXED] = torch.tensor(
        [1, *q.shape, indices.shape[-1], attn_sink is not None, topk_length is not None], dtype=torch.int64
    )
    sig[_SIG_FIXED:] = torch.tensor(offsets, dtype=torch.int64)
    return out, lse


def sparse_decode_context_parallel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    slot_offsets: Sequence[int] | torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    head_dim_v: int = 512,
    softmax_scale: float | None = None,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    tile_scheduler_metadata: FlashMLASchedMeta | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 sparse decode over a cache sharded across the ranks of ``group`` (module doc for the rule).

    Args:
        q: ``[b, s_q, h_q, d_qk]`` bf16, the same on every rank.
        k_cache: this rank's shard, an FP8 cache as :func:`sparse_mla.flash_mla_with_kvcache` takes
            (at least ``slot_offsets[r + 1] - slot_offsets[r]`` slots).
        indices: ``[b, s_q, topk]`` int32 global slots, the same on every rank.
        slot_offsets: ``world_size + 1`` ints: rank ``r`` owns ``[slot_offsets[r], slot_offsets[r+1])``.
        group: the process group (default: the world).
        head_dim_v, softmax_scale: as the decode.
        attn_sink: ``[h_q]`` fp32, applied once after the merge.
        topk_length: ``[b]`` int32, applied to the global indices.
        tile_scheduler_metadata: this rank's scheduler object for the local decode (reuse one per
            decode step as with the decode; default: a new one per call).
        backend: the local decode's backend.

    Returns:
        ``out [b, s_q, h_q, 512]`` bf16 and ``lse [b, h_q, s_q]`` fp32 (natural log), the same on
        every rank.

    Raises:
        TypeError / ValueError: bad arguments (the local decode checks its own), a shard smaller
            than its slot range, or torch.distributed not initialised; on every rank when one
            rank's arguments were refused or the ranks disagree on the shapes, ``slot_offsets``
            or which of ``attn_sink``/``topk_length`` they pass (compared in one small all-gather
            after the local decodes).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # every rank validates and runs its local decode, then all ranks compare one small record (an
    # error flag and the call's shape): a refusal on one rank, or ranks that disagree on a shape or
    # the ownership rule, raise on every rank instead of leaving the others in the data collective
    sig = torch.full((_SIG_FIXED + world + 1,), -1, dtype=torch.int64)
    err: Exception | None = None
    try:
        out, lse = _local_part(
            q, k_cache, indices, slot_offsets, world, rank, head_dim_v, softmax_scale, attn_sink, topk_length,
            tile_scheduler_metadata, backend, sig,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        err = e
    sig_dev = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )
    sigs = torch.empty(world * sig.numel(), dtype=torch.int64, device=sig_dev)
    dist.all_gather_into_tensor(sigs, sig.to(sig_dev), group=group)
    sigs = sigs.view(world, -1).cpu()
    if err is not None:
        raise err
    refused = [r for r in range(world) if sigs[r, 0] < 0]
    if refused:
        raise ValueError(f"rank(s) {refused}: their arguments were refused (see the error raised there)")
    differ = [r for r in range(world) if not torch.equal(sigs[r], sigs[rank])]
    if differ:
        raise ValueError(
            "q / indices / slot_offsets / attn_sink / topk_length: the ranks must pass the same shapes and "
            f"slot_offsets; rank {rank} has {sigs[rank, 1:].tolist()}, rank {differ[0]} {sigs[differ[0], 1:].tolist()}"
        )
    b, s_q, h_q, d_v = out.shape
    # one collective: every rank's (out, lse) as one fp32 record per (b, s_q, h)
    part = torch.cat([out.float(), lse.permute(0, 2, 1).unsqueeze(-1)], dim=-1).contiguous()
    # gathered along dim 0 (the layout every backend takes; gloo takes no stacked output)
    parts = torch.empty((world * b, *part.shape[1:]), dtype=part.dtype, device=part.device)
    dist.all_gather_into_tensor(parts, part, group=group)
    parts = parts.view(world, *part.shape)
    merged, mlse = merge_attention_states(parts[..., :d_v], parts[..., d_v].contiguous())
    if attn_sink is not None:
        lonely = torch.isposinf(mlse)
        factor = torch.sigmoid(mlse - attn_sink.float().to(mlse.device))
        merged = torch.where(lonely.unsqueeze(-1), torch.zeros_like(merged), merged * factor.unsqueeze(-1))
    return merged.to(torch.bfloat16), mlse.permute(0, 2, 1).contiguous()
