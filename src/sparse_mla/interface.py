"""FlashMLA-compatible Python API (seed steps 1-2; DESIGN §3).

``import sparse_mla as flash_mla`` works for callers of FlashMLA 1.0's sparse FP8 decode::

    sched_meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, k_cache, None, None, head_dim_v=512, tile_scheduler_metadata=sched_meta,
        is_fp8_kvcache=True, indices=indices)

Every argument is validated before anything runs on the device; a bad one raises
``ValueError``/``TypeError`` naming it. The scheduler metadata is computed on the first call
(one host read of ``topk_length``) and reused by later calls with the same configuration,
which therefore do no host-device synchronisation (CUDA-graph safe).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ._runtime import use_triton
from .kvcache import KVCacheLayout, _check_quantized_cache, get_layout
from .scheduler import ScheduleTable, batch_num_blocks, compute_num_sm_parts, schedule

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "DEFAULT_CPU_NUM_SMS"]

#: SM count assumed for CPU tensors (the seed's H800/SM90 figure, so CPU runs schedule like it).
DEFAULT_CPU_NUM_SMS = 132
#: Largest ``num_sms`` accepted (partitions get accumulators of ``b + num_sm_parts`` rows).
MAX_NUM_SMS = 1024


@dataclass
class FlashMLASchedMeta:
    """Tile-scheduler state shared by the calls of one decode step (FlashMLA's ``FlashMLASchedMeta``).

    Empty until the first :func:`flash_mla_with_kvcache` call fills it; later calls must use the
    same configuration (shapes, ``topk_length`` presence, device), else ``ValueError``.
    ``topk_length`` *values* are read only on the first call: a caller whose lengths change
    must ask :func:`get_mla_metadata` for a new object (as with FlashMLA).

    Attributes:
        num_sms: SM count to schedule for (None: the device's).
        have_initialized: whether ``table`` is filled.
        config: the configuration the table was computed for.
        table: the :class:`~sparse_mla.scheduler.ScheduleTable` on the device.
    """

    num_sms: Optional[int] = None
    have_initialized: bool = False
    config: Optional[tuple] = None
    table: Optional[ScheduleTable] = field(default=None, repr=False)

    @property
    def tile_scheduler_metadata(self) -> Optional[torch.Tensor]:
        """``[num_sm_parts, 8]`` int32 (see :mod:`sparse_mla.scheduler`), or None before use."""
        return None if self.table is None else self.table.metadata

    @property
    def num_splits(self) -> Optional[torch.Tensor]:
        """``[b + 1]`` int32 prefix sums of splits per batch, or None before use."""
        return None if self.table is None else self.table.num_splits


def get_mla_metadata(*args: Any, num_sms: Optional[int] = None, **kwargs: Any) -> tuple[FlashMLASchedMeta, None]:
    """Return an empty scheduler object, filled on first use: ``(sched_meta, None)``.

    Positional and other keyword arguments are accepted and ignored, as in FlashMLA 1.0.

    Args:
        num_sms: schedule for this many SMs (1..1024) instead of the device's (tests, what-if studies).

    Raises:
        ValueError: ``num_sms`` is not an int in [1, 1024].
    """
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int) or not 0 < num_sms <= MAX_NUM_SMS):
        raise ValueError(f"num_sms: expected an int in [1, {MAX_NUM_SMS}] or None, got {num_sms!r}")
    return FlashMLASchedMeta(num_sms=num_sms), None


def heads_per_cta(h_q: int) -> int:
    """Heads one decode program serves: 16 for h_q <= 16, else 64 (padded, as FlashMLA does).

    Measured on the H200 (docs/perf.md): a 32-head tile ran slower than a 64-head one (644 vs
    427 µs at b=128, s_q=2, topk 2048), since the gather and dequantisation of a 64-token step
    cost the same whatever the number of heads; 16-head tiles ran as fast as 64-head ones.
    """
    return 16 if h_q <= 16 else 64


def _device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_CPU_NUM_SMS


def _check_tensor(x: Any, name: str, dtypes: tuple, dim: int, device: Optional[torch.device] = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {x.dtype}")
    if x.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor, got shape {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where q is), got {x.device}")
    return x


def _check_lengths(x: Optional[torch.Tensor], name: str, b: int, device: torch.device) -> None:
    if x is None:
        return
    _check_tensor(x, name, (torch.int32,), 1, device)
    if x.shape[0] != b:
        raise ValueError(f"{name}: expected shape [b={b}], got {list(x.shape)}")


@dataclass(frozen=True)
class DecodeProblem:
    """A validated sparse decode call (what the kernels and the reference need)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    indices: torch.Tensor
    layout: KVCacheLayout
    sm_scale: float
    d_v: int
    topk_length: Optional[torch.Tensor]
    attn_sink: Optional[torch.Tensor]
    extra_k_cache: Optional[torch.Tensor]
    extra_indices: Optional[torch.Tensor]
    extra_topk_length: Optional[torch.Tensor]


def validate_sparse_decode(
    q: Any,
    k_cache: Any,
    head_dim_v: Any,
    indices: Any,
    softmax_scale: Any = None,
    is_fp8_kvcache: bool = True,
    causal: bool = False,
    attn_sink: Any = None,
    extra_k_cache: Any = None,
    extra_indices_in_kvcache: Any = None,
    topk_length: Any = None,
    extra_topk_length: Any = None,
) -> DecodeProblem:
    """Check every argument of the sparse decode path; raise ``TypeError``/``ValueError`` naming it.

    The kernels read the 1-D ``topk_length``, ``extra_topk_length`` and ``attn_sink`` as dense
    arrays: views of them (strided, expanded, offset) are made contiguous here, on the device
    (a copy of ``b`` or ``h_q`` values, no host synchronisation). Every other tensor's strides are
    honoured by the kernels. ``b = 0`` or ``s_q = 0`` is valid (an empty step).
    """
    _check_tensor(q, "q", (torch.bfloat16,), 4)
    b, s_q, h_q, d_qk = q.shape
    dev = q.device
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"q: expected a CPU or CUDA tensor (others follow q's device), got one on {dev}")
    if d_qk not in (576, 512):
        raise ValueError(f"q: head dim d_qk must be 576 (V3.2 layout) or 512 (MODEL1 layout), got {d_qk}")
    if h_q < 1:
        raise ValueError(f"q: h_q must be >= 1, got shape {list(q.shape)}")
    if h_q > 128:
        raise ValueError(f"q: h_q must be <= 128 (one KV head serves at most 128 query heads), got {h_q}")
    lay = get_layout(d_qk)
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, numbers.Integral) or head_dim_v != lay.d_v:
        raise ValueError(f"head_dim_v: expected {lay.d_v}, got {head_dim_v!r}")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache: the sparse decode (indices given) needs an FP8 cache; pass is_fp8_kvcache=True")
    if causal:
        raise ValueError("causal: must be False for the sparse decode (the top-k indices already select the keys)")
    if softmax_scale is None:
        sm_scale = d_qk ** -0.5
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
        sm_scale = float(softmax_scale)
        if not (sm_scale > 0 and sm_scale < float("inf")):
            raise ValueError(f"softmax_scale: expected a finite positive float, got {softmax_scale!r}")

    def check_cache(kc: Any, name: str) -> None:
        if not isinstance(kc, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(kc).__name__}")
        if kc.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev} (where q is), got {kc.device}")
        if kc.dim() == 4 and kc.shape[2] != 1:
            raise ValueError(f"{name}: h_kv (dim 2) must be 1 for MLA, got {kc.shape[2]}")
        _check_quantized_cache(kc, lay, name)
        if kc.shape[0] < 1 or kc.shape[1] < 1:
            raise ValueError(f"{name}: needs at least one block of at least one token, got {list(kc.shape)}")

    def check_indices(ix: Any, name: str) -> None:
        if not isinstance(ix, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(ix).__name__}")
        if ix.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype torch.int32, got {ix.dtype}")
        if ix.dim() != 3 or ix.shape[0] != b or ix.shape[1] != s_q:
            raise ValueError(f"{name}: expected shape [b={b}, s_q={s_q}, topk], got {list(ix.shape)}")
        if ix.shape[2] < 1:
            raise ValueError(f"{name}: topk must be >= 1, got {ix.shape[2]}")
        if ix.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev} (where q is), got {ix.device}")

    check_cache(k_cache, "k_cache")
    check_indices(indices, "indices")
    _check_lengths(topk_length, "topk_length", b, dev)
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache: give both or neither")
    if extra_k_cache is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_k_cache")
    if extra_k_cache is not None:
        check_cache(extra_k_cache, "extra_k_cache")
        check_indices(extra_indices_in_kvcache, "extra_indices_in_kvcache")
        _check_lengths(extra_topk_length, "extra_topk_length", b, dev)
    if attn_sink is not None:
        _check_tensor(attn_sink, "attn_sink", (torch.float32,), 1, dev)
        if attn_sink.shape[0] != h_q:
            raise ValueError(f"attn_sink: expected shape [h_q={h_q}], got {list(attn_sink.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q: the last dimension must be contiguous (stride 1)")
    return DecodeProblem(
        q, k_cache, indices, lay, sm_scale, lay.d_v, _dense(topk_length), _dense(attn_sink),
        extra_k_cache, extra_indices_in_kvcache, _dense(extra_topk_length),
    )


def _dense(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 1-D tensor the kernels can index as ``ptr + i``: itself when contiguous, else a copy."""
    return None if x is None else x.contiguous()


def _config_of(p: DecodeProblem, num_sms: int) -> tuple:
    b, s_q, h_q, d_qk = p.q.shape
    return (
        b, s_q, h_q, d_qk, p.indices.shape[2],
        p.topk_length is not None,
        None if p.extra_indices is None else p.extra_indices.shape[2],
        p.extra_topk_length is not None,
        num_sms, str(p.q.device),
    )


def _ensure_schedule(meta: FlashMLASchedMeta, p: DecodeProblem) -> ScheduleTable:
    """Fill ``meta`` on first use (reads topk_length once); check the configuration after."""
    num_sms = meta.num_sms or _device_num_sms(p.q.device)
    cfg = _config_of(p, num_sms)
    if meta.have_initialized:
        if meta.config != cfg:
            raise ValueError(
                "tile_scheduler_metadata: this object was filled for (b, s_q, h_q, d_qk, topk, has_topk_length, "
                f"extra_topk, has_extra_topk_length, num_sms, device) = {meta.config}, but this call has {cfg}; "
                "call get_mla_metadata() again for a new configuration"
            )
        assert meta.table is not None
        return meta.table
    b, s_q, h_q, _ = p.q.shape
    tl_host = None if p.topk_length is None else p.topk_length.tolist()
    etl_host = None if p.extra_topk_length is None else p.extra_topk_length.tolist()
    extra_topk = 0 if p.extra_indices is None else p.extra_indices.shape[2]
    main, total = batch_num_blocks(b, p.indices.shape[2], tl_host, extra_topk, etl_host)
    parts = compute_num_sm_parts(num_sms, s_q, h_q, heads_per_cta(h_q))
    table = schedule(total, parts, main_blocks=main).to(p.q.device)
    meta.table, meta.config, meta.have_initialized = table, cfg, True
    return table


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over an FP8 paged latent KV cache (FlashMLA 1.0's signature and semantics).

    The sparse path (``indices`` given) is implemented; the dense path is planned.

    Args:
        q: ``[b, s_q, h_q, d_qk]`` bf16 queries; ``d_qk`` 576 (V3.2 layout) or 512 (MODEL1
            layout); ``h_q <= 128``; last dim contiguous, other strides free.
        k_cache: ``[num_blocks, page_block_size, 1, bytes_per_token]`` ``float8_e4m3fn`` or
            ``uint8`` bytes; 656 B/token (V32) or 584 (MODEL1; any block stride of at least
            ``page_block_size * 584`` bytes).
            May be a strided view of a larger pool (its block stride is honoured).
        block_table: ``[b, max_blocks]`` int32 — dense path only; ignored when ``indices`` is given.
        cache_seqlens: ``[b]`` int32 — dense path only; ignored when ``indices`` is given.
        head_dim_v: 512.
        tile_scheduler_metadata: the object from :func:`get_mla_metadata`.
        num_splits: must be None (FlashMLA 1.0 keeps it in ``tile_scheduler_metadata``).
        softmax_scale: default ``d_qk ** -0.5``.
        causal: must be False on the sparse path.
        is_fp8_kvcache: must be True on the sparse path.
        indices: ``[b, s_q, topk]`` int32, ``block * page_block_size + offset`` into ``k_cache``;
            ``-1`` or any value outside ``[0, num_blocks * page_block_size)`` is ignored.
        attn_sink: ``[h_q]`` fp32: out scaled by ``exp(lse) / (exp(lse) + exp(sink))``.
        extra_k_cache: second cache (same format) attended in the same softmax.
        extra_indices_in_kvcache: ``[b, s_q, extra_topk]`` int32 into ``extra_k_cache``.
        topk_length: ``[b]`` int32: only the first ``topk_length[i]`` indices of batch i count.
        extra_topk_length: ``[b]`` int32, the same for the extra cache.

    Returns:
        ``out [b, s_q, h_q, 512]`` bf16 and ``lse [b, h_q, s_q]`` fp32 (natural log; +inf and
        out = 0 for a query with no valid key). ``b = 0`` or ``s_q = 0`` gives empty tensors of
        these shapes and launches nothing (the scheduler object stays as it was).

    Non-finite inputs: a valid key whose score ``q·k`` is NaN or ``+inf`` (inf/NaN in ``q``)
    makes that query head's ``out`` and ``lse`` NaN; a score of ``-inf`` gives its key weight 0.
    A NaN ``attn_sink[h]`` makes head h's ``out`` NaN (lse unchanged); the lonely-query rule
    (out 0, lse +inf) holds whatever the sink.

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype, shape or device.
        NotImplementedError: the dense path (``indices`` is None).
    """
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise TypeError(
            "tile_scheduler_metadata: expected the FlashMLASchedMeta from get_mla_metadata(), "
            f"got {type(tile_scheduler_metadata).__name__}"
        )
    if num_splits is not None:
        raise ValueError("num_splits: must be None (the splits live in tile_scheduler_metadata)")
    if indices is None:
        raise NotImplementedError(
            "dense decode (indices=None) is planned but not implemented yet; pass indices for the sparse path"
        )
    p = validate_sparse_decode(
        q, k_cache, head_dim_v, indices, softmax_scale, is_fp8_kvcache, causal, attn_sink,
        extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length,
    )
    if is_empty(p):
        return empty_outputs(p)
    return run_sparse_decode(p, _ensure_schedule(tile_scheduler_metadata, p))


def is_empty(p: DecodeProblem) -> bool:
    """An empty step (``b = 0`` or ``s_q = 0``): nothing to schedule or launch."""
    return p.q.shape[0] == 0 or p.q.shape[1] == 0


def empty_outputs(p: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [b, s_q, h_q, d_v]`` bf16 and ``lse [b, h_q, s_q]`` fp32 of an empty step (no launch)."""
    b, s_q, h_q, _ = p.q.shape
    return (p.q.new_empty((b, s_q, h_q, p.d_v), dtype=torch.bfloat16),
            p.q.new_empty((b, h_q, s_q), dtype=torch.float32))


def run_sparse_decode(p: DecodeProblem, table: ScheduleTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a validated call: the Triton kernels on CUDA (and on the CPU under ``TRITON_INTERPRET=1``),
    else the split-KV PyTorch reference. Returns ``(out bf16, lse fp32)``; an empty step launches
    nothing."""
    if is_empty(p):
        return empty_outputs(p)
    if use_triton(p.q.device):
        from .ops.sparse_decode import sparse_decode_fwd

        return sparse_decode_fwd(p, table)
    from .reference import sparse_decode_split_reference

    out, lse = sparse_decode_split_reference(
        p.q, p.k_cache, p.indices, table, p.sm_scale, p.d_v, p.topk_length, p.attn_sink,
        p.extra_k_cache, p.extra_indices, p.extra_topk_length,
    )
    return out.to(torch.bfloat16), lse
