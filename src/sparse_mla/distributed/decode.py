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

**Consistency record.** Before the data all-gather the ranks all-gather one small int64 record
(``(79 + world_size + 1) * 8`` bytes per rank, 656 B for two ranks): an error flag, the shapes,
``head_dim_v``, the resolved ``softmax_scale`` (its float64 bits), the dtypes of ``q`` and
``k_cache`` and its bytes per token, which of ``attn_sink`` / ``topk_length`` are given, the
``attn_sink`` values (as float32 bits, up to 128 heads; NaNs equal to NaNs, -0.0 to 0.0), a
checksum of the ``topk_length`` values and one of the ``indices`` (computed on their device, so
no host synchronisation beyond the one the record's gather already makes) and ``slot_offsets``.
Every rank compares every rank's record: a rank whose own checks refused its arguments still
joins the gather, and then every rank raises; ranks that disagree raise ``ValueError`` on every
rank, naming each argument that differs and which ranks pass which value — instead of a merge of
parts computed with different arguments.
"""

from __future__ import annotations

import numbers
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..api import flash_mla_with_kvcache
from ..core.checks import check_vector
from ..decode.plan import FlashMLASchedMeta, get_mla_metadata
from ..decode.problem import MAX_H_Q
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


# ------------------------------------------------------------------------------------------------
# the consistency record: int64 words, the same length on every rank (it depends on world only)

#: words filled on the host: ok, b, s_q, h_q, d_qk, topk, sink given, topk_length given,
#: head_dim_v, softmax_scale (float64 bits), q dtype, k_cache dtype, k_cache bytes per token
_SIG_HOST = 13
#: words computed on the inputs' device: topk_length checksum, indices checksum, then the
#: attn_sink values as float32 bits, two per word (MAX_H_Q floats)
_SIG_DEVICE = 2 + MAX_H_Q // 2
#: the record's words before the slot offsets (``world + 1`` of them follow)
_SIG_FIXED = _SIG_HOST + _SIG_DEVICE
_SINK_AT = _SIG_HOST + 2

_U64 = 1 << 64
_GOLDEN = 0x9E3779B97F4A7C15 - _U64
_MUL1 = 0xBF58476D1CE4E5B9 - _U64
_MUL2 = 0x94D049BB133111EB - _U64
_F32_NAN = 0x7FC00000


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 words (wrap-around multiplies; logical shifts as arithmetic
    shifts masked to the bits a logical shift keeps)."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _MUL1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _MUL2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _int32_checksum(x: torch.Tensor) -> torch.Tensor:
    """A deterministic 64-bit checksum of an int32 tensor's values in row-major order: the wrap-around
    sum over positions ``i`` of ``mix64((i << 32 | (x_i mod 2^32)) ^ golden)``. A 0-d int64 tensor
    on ``x``'s device (torch ops only: no host synchronisation); the same on every device for the
    same values, so ranks compare it to detect different contents."""
    v = x.reshape(-1).long() & 0xFFFFFFFF
    pos = torch.arange(v.numel(), device=x.device, dtype=torch.int64)
    return _mix64(((pos << 32) | v) ^ _GOLDEN).sum()


def _sink_words(attn_sink: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``attn_sink``'s float32 bits (every NaN as one pattern, -0.0 as 0.0) padded with 0 to
    ``MAX_H_Q`` and read as ``MAX_H_Q / 2`` int64 words, on ``device``."""
    bits = torch.zeros(MAX_H_Q, dtype=torch.int32, device=device)
    if attn_sink is not None:
        s = attn_sink.float()
        b = s.view(torch.int32)
        b = torch.where(torch.isnan(s), torch.full_like(b, _F32_NAN), b)
        bits[: s.numel()] = torch.where(s == 0, torch.zeros_like(b), b)
    return bits.view(torch.int64)


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _fill_record(
    q, k_cache, indices, head_dim_v, softmax_scale, attn_sink, topk_length, offsets, sig_dev
) -> torch.Tensor:
    """The record of a rank whose local decode accepted its arguments (on ``sig_dev``)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)  # as the decode resolves it
    host = [
        1, *q.shape, indices.shape[-1], int(attn_sink is not None), int(topk_length is not None), int(head_dim_v),
        _f64_bits(scale), _dtype_code(q.dtype), _dtype_code(k_cache.dtype), k_cache.shape[-1],
    ]  # fmt: skip
    zero = torch.zeros((), dtype=torch.int64, device=indices.device)
    dev = torch.cat(
        [
            (zero if topk_length is None else _int32_checksum(topk_length)).view(1),
            _int32_checksum(indices).view(1),
            _sink_words(attn_sink, indices.device),
        ]
    )
    words = torch.tensor(host + offsets, dtype=torch.int64).to(sig_dev)
    return torch.cat([words[:_SIG_HOST], dev.to(sig_dev), words[_SIG_HOST:]])


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _disagree(name: str, values: list[Any], fmt=str, detail: str = "") -> str | None:
    """``"name: ranks disagree (rank 0: v0, ranks 1, 2: v1)"`` when the ranks' ``values`` differ."""
    groups: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    if len(groups) == 1:
        return None
    return f"{name}: ranks disagree ({detail}" + ", ".join(f"{_ranks(rs)}: {fmt(v)}" for v, rs in groups.items()) + ")"


def _f32(bits: int) -> str:
    return repr(struct.unpack("<f", struct.pack("<i", bits))[0])


def _sink_disagreement(sigs: torch.Tensor, h_q: int) -> str | None:
    """The first head whose (canonical) ``attn_sink`` bits differ between the ranks, and how many do."""
    bits = sigs[:, _SINK_AT : _SINK_AT + MAX_H_Q // 2].contiguous().view(torch.int32)[:, :h_q]
    heads = (bits != bits[:1]).any(dim=0).nonzero().flatten().tolist()
    if not heads:
        return None
    h = heads[0]
    detail = f"{len(heads)} of {h_q} heads differ; attn_sink[{h}]: "
    return _disagree("attn_sink", bits[:, h].tolist(), _f32, detail)


def _disagreements(sigs: torch.Tensor, world: int) -> list[str]:
    """One message per argument on which the gathered records ``sigs [world, words]`` differ."""
    rows = sigs.tolist()

    def col(i: int, j: int | None = None) -> list[Any]:
        return [row[i] if j is None else tuple(row[i:j]) for row in rows]

    def given(v: int) -> str:
        return "given" if v else "None"

    def checksum(v: int) -> str:
        return f"checksum {v % _U64:#018x}"

    def dtype(v: int) -> str:
        names = {_dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
        return names.get(v, f"dtype code {v}")

    f64 = struct.Struct("<q")
    fields = [
        ("q.shape", col(1, 5), lambda v: str(list(v))),
        ("q.dtype", col(10), dtype),
        ("indices.shape[-1] (topk)", col(5), str),
        ("k_cache.dtype", col(11), dtype),
        ("k_cache.shape[-1] (bytes per token)", col(12), str),
        ("head_dim_v", col(8), str),
        ("softmax_scale", col(9), lambda v: repr(struct.unpack("<d", f64.pack(v))[0])),
        ("attn_sink", col(6), given),
        ("topk_length", col(7), given),
        ("slot_offsets", col(_SIG_FIXED, _SIG_FIXED + world + 1), lambda v: str(list(v))),
    ]
    msgs = [m for name, vals, fmt in fields if (m := _disagree(name, vals, fmt)) is not None]
    shapes_agree = all(len(set(col(i))) == 1 for i in range(1, 8))
    if shapes_agree:  # the contents are comparable: same shapes, same optional arguments given
        if rows[0][7]:
            msgs.append(_disagree("topk_length", col(_SIG_HOST), checksum))
        msgs.append(_disagree("indices", col(_SIG_HOST + 1), checksum))
        if rows[0][6]:
            msgs.append(_sink_disagreement(sigs, rows[0][3]))
    return [m for m in msgs if m is not None]


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
    sig_dev,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's checks and local decode; returns ``(out, lse, record)`` (the record the ranks compare)."""
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
    sig = _fill_record(q, k_cache, indices, head_dim_v, softmax_scale, attn_sink, topk_length, offsets, sig_dev)
    return out, lse, sig


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
            (at least ``slot_offsets[r + 1] - slot_offsets[r]`` slots); the same dtype and bytes
            per token on every rank.
        indices: ``[b, s_q, topk]`` int32 global slots, the same on every rank.
        slot_offsets: ``world_size + 1`` ints: rank ``r`` owns ``[slot_offsets[r], slot_offsets[r+1])``.
        group: the process group (default: the world).
        head_dim_v, softmax_scale: as the decode, the same on every rank.
        attn_sink: ``[h_q]`` fp32, applied once after the merge; given on every rank or on none,
            with the same values.
        topk_length: ``[b]`` int32, applied to the global indices; given on every rank or on none,
            with the same values.
        tile_scheduler_metadata: this rank's scheduler object for the local decode (reuse one per
            decode step as with the decode; default: a new one per call).
        backend: the local decode's backend.

    Returns:
        ``out [b, s_q, h_q, 512]`` bf16 and ``lse [b, h_q, s_q]`` fp32 (natural log), the same on
        every rank.

    Consistency: after the local decodes the ranks all-gather one int64 record of
    ``(79 + world_size + 1) * 8`` bytes each (656 B for two ranks) and compare, on every rank:
    the shapes of ``q`` and ``indices``, ``q.dtype``, ``k_cache.dtype`` and bytes per token,
    ``head_dim_v``, the resolved ``softmax_scale`` (its exact float64 bits), which of
    ``attn_sink`` / ``topk_length`` are given, the ``attn_sink`` values (exactly; every NaN
    equals every NaN, -0.0 equals 0.0), ``slot_offsets``, and 64-bit checksums of the
    ``topk_length`` values and of the ``indices`` contents (a wrap-around int64 sum of
    SplitMix64-mixed ``(position, value)`` words, computed by torch ops on their device: no host synchronisation beyond the one the record's gather
    makes; a difference is missed only if the checksums collide). That gather is the call's only
    collective besides the data all-gather.

    Raises:
        TypeError / ValueError: bad arguments (the local decode checks its own), a shard smaller
            than its slot range, or torch.distributed not initialised. On every rank: a
            ``ValueError`` when one rank's arguments were refused (that rank raises its own
            error), or when the ranks disagree on any argument the record holds (the message
            names each such argument and which ranks pass which value, e.g. ``softmax_scale:
            ranks disagree (rank 0: 0.041666666666666664, rank 1: 0.05)``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    sig_dev = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )
    # every rank validates and runs its local decode, then all ranks compare one small record (an
    # error flag and the call's arguments): a refusal on one rank, or ranks that disagree on an
    # argument, raise on every rank instead of leaving the others in the data collective or
    # merging parts computed with different arguments. A refused rank sends a record of -1 (its
    # error flag) and still joins the gather.
    sig = torch.full((_SIG_FIXED + world + 1,), -1, dtype=torch.int64, device=sig_dev)
    err: Exception | None = None
    try:
        out, lse, sig = _local_part(
            q, k_cache, indices, slot_offsets, world, rank, head_dim_v, softmax_scale, attn_sink, topk_length,
            tile_scheduler_metadata, backend, sig_dev,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        err = e
    sigs = torch.empty(world * sig.numel(), dtype=torch.int64, device=sig_dev)
    dist.all_gather_into_tensor(sigs, sig, group=group)
    sigs = sigs.view(world, -1).cpu()
    if err is not None:
        raise err
    refused = [r for r in range(world) if sigs[r, 0] < 0]
    if refused:
        raise ValueError(f"rank(s) {refused}: their arguments were refused (see the error raised there)")
    differ = _disagreements(sigs, world)
    if differ:
        raise ValueError("; ".join(differ) + " (every rank must pass the same arguments)")
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
