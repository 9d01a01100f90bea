"""Decode-loop simulation of an inference engine's serving path (``sparse-mla serve-sim``).

``B`` requests with different context lengths share one paged FP8 cache (blocks handed out from a
shuffled free list as contexts grow). Every step does what an engine does per decode step:

1. the new token of every request gets a latent vector ``kv [B, d_qk]`` (random bf16 here, each
   64-value tile with its own magnitude in 10^-2..10^0) and a query ``q [B, 1, h_q, d_qk]``;
2. its cache slot is the cache index of position ``ctx[i]`` (the index-conversion kernel on the
   block table), and :func:`~sparse_mla.kvcache.store.quantize_and_store_kv` writes it; ``ctx += 1``;
3. the "indexer" picks ``topk`` distinct positions of each request's valid context ``[0, ctx)``:
   ``pos_j = (a * j + c) mod ctx`` for ``j < min(topk, ctx)`` with a random prime ``a > max_context``
   (coprime to every length, so the positions are distinct) and a random offset ``c``; slots
   ``j >= ctx`` get ``-1``. This costs a few elementwise kernels, unlike a real top-k over indexer
   scores, so the step time is the attention path's. The index-conversion kernel turns them into
   cache indices. With ``--indexer`` (:attr:`ServeSimConfig.indexer`) the lightning indexer picks
   them instead: each new token's indexer key is quantised into its FP8 key cache (same pages as
   the attention cache), :func:`~sparse_mla.indexer.fp8_paged_mqa_logits` scores every context
   token, and :func:`~sparse_mla.indexer.topk_kvcache_indices` returns the top-k as cache slots
   (``sorted=False``: the decode attends a set);
4. :func:`sparse_mla.flash_mla_with_kvcache` runs the sparse decode (s_q = 1).

On CUDA, steps 1-4 are captured once in a ``torch.cuda.CUDAGraph`` after one eager warm-up step
(which compiles the kernels and fills the scheduler metadata) and replayed every step; all
per-step state (context lengths, random numbers) lives on the device, so a replay needs no host
input. The host only writes a new block-table entry before a step whose token starts a new page
block. **No ``topk_length`` is passed**: FlashMLA's scheduler reads ``topk_length`` values once,
on the first call, so growing contexts would need a new metadata object (and a re-capture) each
step; instead, positions past a short context are ``-1`` (invalid), which the decode ignores.
The scheduler therefore plans ``ceil(topk / 64)`` blocks for every request, the same as once
every context is ``>= topk`` (the normal case at DeepSeek-V3.2 sizes).

Per-step latency is measured around each replay (CUDA events, or wall-clock on the CPU, with a
device synchronisation per step), and tokens/s = ``B / latency``. At the end the last step is
checked: its decode output against :func:`sparse_mla.reference.sparse_decode_reference` on the same
cache (FlashMLA's own test tolerances, docs/design.md section 6) and the appended tokens' cache bytes against
:func:`sparse_mla.quantize_k_cache`.

The Triton kernels are imported lazily, so the CLI can set ``TRITON_INTERPRET=1`` first on a
machine without a GPU (tiny defaults then run in seconds).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from ..decode.plan import MAX_NUM_SMS, get_mla_metadata
from ..decode.problem import MAX_H_Q
from ..formats import get_layout, quantize_k_cache
from ..indexer.logits import MAX_HEADS
from ..indexer.problem import HEAD_DIMS, INT32_MAX
from .progress import RunProgress, format_bytes, format_seconds, make_progress

__all__ = [
    "ServeSimConfig",
    "ServeSim",
    "available_host_bytes",
    "default_config",
    "MAX_SEED",
    "CPU_DEFAULTS",
    "GPU_DEFAULTS",
]

#: largest seed accepted (torch generators take 64-bit seeds; serve-sim also uses seed + 1)
MAX_SEED = 2**63 - 2
#: tiny sizes for the CPU (Triton interpreter): seconds
CPU_DEFAULTS = dict(batch=2, topk=64, max_context=256, steps=4, h_q=16, page_block_size=64, index_heads=4, index_dim=32)
#: DeepSeek-V3.2 decode sizes for a GPU
GPU_DEFAULTS = dict(
    batch=64, topk=2048, max_context=32768, steps=200, h_q=128, page_block_size=64, index_heads=64, index_dim=128
)


#: the int fields of :class:`ServeSimConfig`: (least, largest or None, why the largest)
_INT_FIELDS: dict[str, tuple[int, int | None, str]] = {
    "batch": (1, None, ""),
    "topk": (1, INT32_MAX, " (int32 positions)"),
    "max_context": (1, INT32_MAX, " (int32 positions)"),
    "steps": (1, None, ""),
    "page_block_size": (1, None, ""),
    "h_q": (1, MAX_H_Q, " (the query heads one KV head serves)"),
    "seed": (0, MAX_SEED, ""),
    "index_heads": (1, MAX_HEADS, " (indexer query heads)"),
}


@dataclass
class ServeSimConfig:
    """Sizes of a simulation.

    Attributes:
        batch: requests ``B`` (>= 1), one new token each per step.
        topk: indices per query token (>= 1).
        max_context: longest context (tokens) any request reaches; request 0 ends exactly there.
        min_context: shortest initial context (default ``max(1, max_context // 8)``).
        steps: timed decode steps (>= 1); one more untimed warm-up step runs first.
        page_block_size: tokens per page block (>= 1).
        h_q: query heads (1..128).
        layout: ``"V32"`` (d_qk 576) or ``"MODEL1"`` (d_qk 512).
        cache_dtype: ``"fp8"`` (float8_e4m3fn) or ``"uint8"`` cache tensor.
        use_graph: capture the step in a CUDA graph (CUDA only; ignored on the CPU).
        seed: random seed (contexts, block placement, token values, indices).
        num_sms: SMs to schedule for (None: the device's).
        check: verify the last step against the references.
        indexer: pick the top-k with the lightning indexer (its key cache written with each new
            token, paged FP8 logits, top-k as cache slots) instead of random positions.
        index_heads, index_dim: the indexer's query heads (1..128) and head dim (16, 32, 64, 128 or
            256; DeepSeek-V3.2: 64, 128).
    """

    batch: int = CPU_DEFAULTS["batch"]
    topk: int = CPU_DEFAULTS["topk"]
    max_context: int = CPU_DEFAULTS["max_context"]
    min_context: int | None = None
    steps: int = CPU_DEFAULTS["steps"]
    page_block_size: int = CPU_DEFAULTS["page_block_size"]
    h_q: int = CPU_DEFAULTS["h_q"]
    layout: str = "V32"
    cache_dtype: str = "fp8"
    use_graph: bool = True
    seed: int = 0
    num_sms: int | None = None
    check: bool = True
    indexer: bool = False
    index_heads: int = 64
    index_dim: int = 128

    def validate(self, names: Mapping[str, str] | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field.

        Args:
            names: how the messages call each field (the command line passes its flags,
                ``{"index_dim": "--index-dim", ...}``); a field not in it keeps its own name.
        """

        def n(field_name: str) -> str:
            return (names or {}).get(field_name, field_name)

        for name, (lo, hi, why) in _INT_FIELDS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                want = "a positive int" if hi is None else f"an int in [{lo}, {hi}]{why}"
                raise ValueError(f"{n(name)}: expected {want}, got {v!r}")
        if isinstance(self.index_dim, bool) or self.index_dim not in HEAD_DIMS:
            raise ValueError(
                f"{n('index_dim')}: expected one of {', '.join(map(str, HEAD_DIMS))} (the indexer kernels' head dims, "
                f"powers of two; each cached key is index_dim FP8 bytes + a 4-byte scale), got {self.index_dim!r}"
            )
        for name, allowed in (("layout", ("V32", "MODEL1")), ("cache_dtype", ("fp8", "uint8"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{n(name)}: expected {' or '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
        self._validate_context(n)
        if self.num_sms is not None and (
            isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int) or not 1 <= self.num_sms <= MAX_NUM_SMS
        ):
            raise ValueError(f"{n('num_sms')}: expected an int in [1, {MAX_NUM_SMS}] or None, got {self.num_sms!r}")

    def _validate_context(self, n: Callable[[str], str]) -> None:
        """``min_context``, and the contexts' room for the steps and in the int32 cache indices."""
        mc = self.resolved_min_context()
        if isinstance(mc, bool) or not isinstance(mc, int) or mc < 1:
            raise ValueError(f"{n('min_context')}: expected a positive int, got {self.min_context!r}")
        if mc + self.steps + 1 > self.max_context:
            raise ValueError(
                f"{n('max_context')}: {self.max_context} leaves no room for {n('min_context')} {mc} plus "
                f"{self.steps} steps ({n('steps')}) and one warm-up step; raise {n('max_context')} or lower "
                f"{n('min_context')} or {n('steps')}"
            )
        one = -(-self.max_context // self.page_block_size) * self.page_block_size  # one request's slots
        slots = self.batch * one
        if slots > INT32_MAX:
            # blame a page larger than the context (its padding makes the slots), then a context too
            # long for one request, else the number of requests
            culprit = (
                "page_block_size"
                if self.page_block_size > self.max_context
                else ("max_context" if one > INT32_MAX else "batch")
            )
            raise ValueError(
                f"{n(culprit)}: {self.batch} requests of {n('max_context')} {self.max_context} tokens in pages of "
                f"{n('page_block_size')} {self.page_block_size} need {slots} cache slots, more than the int32 "
                "cache indices hold (2^31 - 1)"
            )

    def resolved_min_context(self) -> int:
        return max(1, self.max_context // 8) if self.min_context is None else self.min_context


def default_config(device: torch.device, **overrides: Any) -> ServeSimConfig:
    """Tiny sizes on the CPU, DeepSeek-V3.2 sizes on CUDA; ``None`` overrides are ignored."""
    base = dict(GPU_DEFAULTS if torch.device(device).type == "cuda" else CPU_DEFAULTS)
    base.update({k: v for k, v in overrides.items() if v is not None})
    return ServeSimConfig(**base)


def _primes_above(lo: int, count: int) -> list[int]:
    out, n = [], max(lo + 1, 3)
    while len(out) < count:
        if n % 2 and all(n % d for d in range(3, int(math.isqrt(n)) + 1, 2)):
            out.append(n)
        n += 1
    return out


@dataclass
class StepTimes:
    """Per-step latencies (seconds) and derived statistics."""

    latencies: list[float] = field(default_factory=list)

    def percentile(self, p: float) -> float:
        xs = sorted(self.latencies)
        if not xs:
            return float("nan")
        k = (len(xs) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def available_host_bytes() -> int | None:
    """The host memory this process may still use: ``MemAvailable`` of ``/proc/meminfo``
    (reclaimable page cache counts; else the physical memory), less where a cgroup (a container)
    limits it below that; None where none of them can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" / a huge number: no limit
            left = max(int(limit) - usage, 0)
            avail = left if avail is None else min(avail, left)
        break
    return avail


def _check_fits(parts: dict[str, tuple[int, bool]], device: torch.device) -> None:
    """Refuse sizes the machine cannot hold before allocating anything: a machine that overcommits
    memory would otherwise grant the allocation and kill the process when it is touched.

    Args:
        parts: :meth:`ServeSim.memory_parts`; the message names the largest.

    Raises:
        MemoryError: the host parts (all of them on the CPU) exceed the available host memory, or
            the device parts the free memory of the CUDA device.
    """
    gib = 2.0**30

    def largest(on_device: bool | None) -> str:
        what, (b, _) = max(
            ((w, p) for w, p in parts.items() if on_device is None or p[1] == on_device), key=lambda x: x[1][0]
        )
        return f"; the largest part: {what}, {b / gib:.2f} GiB"

    host = sum(b for b, on_device in parts.values() if not on_device)
    dev = sum(b for b, on_device in parts.values() if on_device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        if dev > free:
            raise MemoryError(
                f"needs at least {dev / gib:.2f} GiB on cuda:{index}, {free / gib:.2f} GiB free{largest(True)}"
            )
        where = False
    else:
        host += dev
        where = None
    avail = available_host_bytes()
    if avail is not None and host > avail:
        raise MemoryError(
            f"needs at least {host / gib:.2f} GiB of host memory, {avail / gib:.2f} GiB available{largest(where)}"
        )


class ServeSim:
    """State and step of the simulated decode loop (see the module docstring).

    Args:
        cfg: the sizes (validated here).
        device: ``"cpu"`` (Triton interpreter when ``TRITON_INTERPRET=1``, else the PyTorch
            references) or ``"cuda"``.

    Attributes (device tensors, valid after :meth:`prefill`):
        k_cache: ``[num_blocks, page_block_size, 1, bytes_per_token]`` the paged FP8 cache
            (unallocated slots hold 0xFF bytes = NaN, which must never reach an output).
        block_table: ``[B, max_blocks_per_seq]`` int32 (``-1`` = not allocated).
        ctx: ``[B]`` int32 current context lengths (device copy; ``ctx_host`` mirrors it).
        kv_buf, slot_buf, q_buf, pos_buf, idx_buf: the last step's new tokens ``[B, d_qk]`` bf16,
            their slots ``[B]`` int32, queries ``[B, 1, h_q, d_qk]`` bf16, logical top-k positions
            and cache indices ``[B, 1, topk]`` int32.
        out, lse: the last step's decode output ``[B, 1, h_q, 512]`` bf16 and ``[B, h_q, 1]`` fp32.

    Raises:
        ValueError: bad config or device.
        MemoryError: the sizes need more memory than the machine has free (checked before anything
            is allocated, from the lower bounds of :meth:`memory_parts`).
    """

    def __init__(self, cfg: ServeSimConfig, device: str | torch.device = "cpu") -> None:
        cfg.validate()
        self.cfg = cfg
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: cuda requested but torch.cuda.is_available() is False")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: expected cpu or cuda, got {self.device}")
        self.lay = get_layout(cfg.layout)
        self.B, self.pbs, self.topk = cfg.batch, cfg.page_block_size, cfg.topk
        _check_fits(self.memory_parts(), self.device)
        self.use_graph = cfg.use_graph and self.device.type == "cuda"
        g = torch.Generator().manual_seed(cfg.seed)
        self._host_gen = g
        # device RNG: the default CUDA generator (CUDA-graph safe), a private one on the CPU
        if self.device.type == "cuda":
            torch.cuda.manual_seed(cfg.seed)
            self._gen: torch.Generator | None = None
        else:
            self._gen = torch.Generator().manual_seed(cfg.seed + 1)
        total = cfg.steps + 1  # + the warm-up step
        lo, hi = cfg.resolved_min_context(), cfg.max_context - total
        ctx0 = torch.randint(lo, hi + 1, (self.B,), generator=g)
        ctx0[0] = hi  # request 0 reaches max_context exactly
        self.ctx_host = ctx0.tolist()
        self.max_blocks = -(-cfg.max_context // self.pbs)
        self.num_blocks = self.B * self.max_blocks
        self.free_blocks = torch.randperm(self.num_blocks, generator=g).tolist()
        self.table_host = torch.full((self.B, self.max_blocks), -1, dtype=torch.int32)
        self.primes = _primes_above(max(cfg.max_context, cfg.topk), 64)
        self.meta, _ = get_mla_metadata(num_sms=cfg.num_sms)
        self.graph: Any | None = None
        self.steps_done = 0
        self._allocated = False

    def memory_estimate(self) -> tuple[int, int]:
        """Lower bounds of the bytes this run holds: ``(host, device)``, the sums of
        :meth:`memory_parts` (on the CPU both bounds are host memory)."""
        parts = self.memory_parts().values()
        return sum(b for b, on_device in parts if not on_device), sum(b for b, on_device in parts if on_device)

    def memory_parts(self) -> dict[str, tuple[int, bool]]:
        """What the run holds, by part: ``{what (with the sizes behind it): (bytes, on the device)}``.

        Lower bounds. Host: the page tables and free-block lists while they are built (~48 bytes a
        block). Device: the paged cache(s) and the step's buffers, and on the CPU the decode's
        gathered keys (``B x topk`` fp32 rows of ``d_qk``: the PyTorch twins and the interpreter
        gather them)."""
        cfg, lay, B = self.cfg, self.lay, self.B
        max_blocks = -(-cfg.max_context // self.pbs)
        blocks = B * max_blocks
        cache = f"batch {B} x max_context {cfg.max_context} in {blocks} pages of page_block_size {self.pbs}"
        parts = {
            f"page tables ({blocks} pages)": (blocks * 48 + B * 64, False),
            f"the paged {lay.name} cache ({cache}, {lay.bytes_per_token} B a token)": (
                blocks * lay.block_bytes(self.pbs),
                True,
            ),
            f"the step's queries and indices (batch {B} x h_q {cfg.h_q}, batch {B} x topk {self.topk})": (
                B * (cfg.h_q * lay.d_qk * 2 + self.topk * 8),
                True,
            ),
        }
        if self.device.type == "cpu":
            what = f"the decode's gathered keys (batch {B} x topk {self.topk} fp32 rows of {lay.d_qk})"
            parts[what] = (B * self.topk * lay.d_qk * 4, True)
        if cfg.indexer:
            what = f"the indexer cache and logits ({cache}, index_dim {cfg.index_dim} + 4 B a token)"
            parts[what] = (blocks * self.pbs * (cfg.index_dim + 4) + B * cfg.max_context * 4, True)
        return parts

    # ---------------------------------------------------------------- setup

    def _alloc_cache(self) -> torch.Tensor:
        lay, nb, pbs = self.lay, self.num_blocks, self.pbs
        bb = lay.block_bytes(pbs)
        buf = torch.full((nb, bb), 0xFF, dtype=torch.uint8, device=self.device)
        if lay.name == "V32":
            kc = buf.view(nb, pbs, 1, lay.bytes_per_token)
        else:
            kc = buf.as_strided((nb, pbs, 1, lay.bytes_per_token), (bb, lay.bytes_per_token, lay.bytes_per_token, 1))
        return kc.view(torch.float8_e4m3fn) if self.cfg.cache_dtype == "fp8" else kc

    def _random_kv(self, n: int) -> torch.Tensor:
        """``[n, d_qk]`` bf16: normal values, each 64-value tile scaled by 10^U(-2, 0)."""
        d = self.lay.d_qk
        x = torch.randn(n, d, device=self.device, generator=self._gen)
        mag = torch.rand(n, d // 64, device=self.device, generator=self._gen) * 2 - 2
        return (x * torch.pow(10.0, mag).repeat_interleave(64, dim=1)).to(torch.bfloat16)

    def _grow_tables(self) -> list[tuple[int, int, int]]:
        """Allocate a block for every request whose next token starts a new page block (host only).

        Returns the new ``(request, logical_block, physical_block)`` entries.
        """
        new = []
        for i, c in enumerate(self.ctx_host):
            lb = c // self.pbs
            if self.table_host[i, lb] < 0:
                blk = self.free_blocks.pop()
                self.table_host[i, lb] = blk
                new.append((i, lb, blk))
        return new

    def _apply_table_updates(self, new: list[tuple[int, int, int]]) -> None:
        if not new:
            return
        upd = torch.tensor(new, dtype=torch.int64).to(self.device)  # one small host-to-device copy
        self.block_table.index_put_((upd[:, 0], upd[:, 1]), upd[:, 2].to(torch.int32))

    def prefill(self, chunk_tokens: int = 65536) -> None:
        """Allocate the cache and write every request's initial context (random tokens)."""
        from ..kvcache.store import quantize_and_store_kv

        dev, pbs = self.device, self.pbs
        self.k_cache = self._alloc_cache()
        # blocks for the initial contexts
        for i, c in enumerate(self.ctx_host):
            for lb in range(-(-c // pbs)):
                self.table_host[i, lb] = self.free_blocks.pop()
        self.block_table = self.table_host.to(dev)
        self.ctx = torch.tensor(self.ctx_host, dtype=torch.int32, device=dev)
        # slots of all initial tokens, request by request
        slots = []
        for i, c in enumerate(self.ctx_host):
            t = torch.arange(c)
            slots.append(self.table_host[i, t // pbs].long() * pbs + t % pbs)
        all_slots = torch.cat(slots).to(dev)
        block_t = None if dev.type == "cuda" else 64
        for s in range(0, all_slots.numel(), chunk_tokens):
            sl = all_slots[s : s + chunk_tokens]
            quantize_and_store_kv(self._random_kv(sl.numel()), sl, self.k_cache, block_t=block_t)
        B, d, topk = self.B, self.lay.d_qk, self.topk
        if self.cfg.indexer:
            self._prefill_indexer(all_slots, chunk_tokens)
        self.kv_buf = torch.empty(B, d, dtype=torch.bfloat16, device=dev)
        self.slot_buf = torch.empty(B, 1, 1, dtype=torch.int32, device=dev)
        self.q_buf = torch.empty(B, 1, self.cfg.h_q, d, dtype=torch.bfloat16, device=dev)
        self.pos_buf = torch.empty(B, 1, topk, dtype=torch.int32, device=dev)
        self.idx_buf = torch.empty(B, 1, topk, dtype=torch.int32, device=dev)
        self.primes_t = torch.tensor(self.primes, dtype=torch.int64, device=dev)
        self.j_t = torch.arange(topk, dtype=torch.int64, device=dev)
        self._allocated = True

    def _prefill_indexer(self, all_slots: torch.Tensor, chunk_tokens: int) -> None:
        """The indexer's key cache (DeepGEMM's paged layout, same pages as the attention cache)
        with every initial token's key, and the step's indexer buffers."""
        from ..core.env import cuda_num_sms
        from ..indexer import get_paged_mqa_logits_metadata, indexer_k_quant_and_cache

        cfg, dev, B = self.cfg, self.device, self.B
        D, H = cfg.index_dim, cfg.index_heads
        self.index_cache = torch.zeros(self.num_blocks, self.pbs, 1, D + 4, dtype=torch.uint8, device=dev)
        for s in range(0, all_slots.numel(), chunk_tokens):
            sl = all_slots[s : s + chunk_tokens]
            k = torch.randn(sl.numel(), D, device=dev, generator=self._gen).to(torch.bfloat16)
            indexer_k_quant_and_cache(k, self.index_cache, sl.long(), "ue8m0")
        self.ik_buf = torch.empty(B, D, dtype=torch.bfloat16, device=dev)
        self.iq_buf = torch.empty(B, 1, H, D, dtype=torch.float8_e4m3fn, device=dev)
        self.w_buf = torch.empty(B, H, dtype=torch.float32, device=dev)
        num_sms = cfg.num_sms or (cuda_num_sms(dev) if dev.type == "cuda" else 4)
        self.logits_meta = get_paged_mqa_logits_metadata(self.ctx, self.pbs, num_sms)

    def _indexer_topk(self) -> None:
        """Step 3 with the indexer: the new tokens' keys into its cache, FP8 logits over each
        request's context, top-k as cache slots into ``idx_buf``."""
        from ..indexer import fp8_paged_mqa_logits, indexer_k_quant_and_cache, topk_kvcache_indices

        B, dev, gen = self.B, self.device, self._gen
        self.ik_buf.copy_(torch.randn(self.ik_buf.shape, device=dev, generator=gen).to(torch.bfloat16))
        indexer_k_quant_and_cache(self.ik_buf, self.index_cache, self.slot_buf.view(B).long(), "ue8m0")
        self.iq_buf.copy_(torch.randn(self.iq_buf.shape, device=dev, generator=gen).to(torch.float8_e4m3fn))
        self.w_buf.copy_(torch.rand(self.w_buf.shape, device=dev, generator=gen))
        self.logits = fp8_paged_mqa_logits(
            self.iq_buf,
            self.index_cache,
            self.w_buf,
            self.ctx,
            self.block_table,
            self.logits_meta,
            self.cfg.max_context,
        )
        # the decode attends a set: no order needed (the top-k leaves its final sort out)
        idx = topk_kvcache_indices(
            self.logits, self.topk, self.block_table, self.pbs, 1, row_ends=self.ctx, sorted=False
        )
        self.idx_buf.copy_(idx.view(B, 1, self.topk))

    # ---------------------------------------------------------------- the step

    def _step_body(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-4 of the module docstring on device tensors only (capturable)."""
        from ..kvcache.index_convert import abs_indices_to_kvcache_indices_triton
        from ..kvcache.store import quantize_and_store_kv

        B, dev, gen = self.B, self.device, self._gen
        # 1. new tokens and queries
        self.kv_buf.copy_(self._random_kv(B))
        self.q_buf.copy_(torch.randn(self.q_buf.shape, device=dev, generator=gen).to(torch.bfloat16))
        # 2. append: slot of position ctx[i], written by the fused quantise-and-store kernel
        abs_indices_to_kvcache_indices_triton(self.ctx.view(B, 1, 1), self.block_table, self.pbs, out=self.slot_buf)
        quantize_and_store_kv(self.kv_buf, self.slot_buf.view(B), self.k_cache)
        self.ctx.add_(1)
        # 3. top-k positions over [0, ctx): the indexer, or an affine permutation with a random prime multiplier
        if self.cfg.indexer:
            self._indexer_topk()
            return self._decode()
        pick = torch.randint(0, len(self.primes), (B,), device=dev, generator=gen)
        a = self.primes_t[pick]
        c = torch.randint(0, 1 << 30, (B,), device=dev, generator=gen)
        n = self.ctx.long().unsqueeze(1)
        pos = (a.unsqueeze(1) * self.j_t + c.unsqueeze(1)) % n
        pos = torch.where(self.j_t.unsqueeze(0) < n, pos, torch.full_like(pos, -1))
        self.pos_buf.copy_(pos.view(B, 1, self.topk))
        abs_indices_to_kvcache_indices_triton(self.pos_buf, self.block_table, self.pbs, out=self.idx_buf)
        return self._decode()

    def _decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """4. the sparse decode over ``idx_buf``."""
        from ..api import flash_mla_with_kvcache

        return flash_mla_with_kvcache(
            self.q_buf,
            self.k_cache,
            None,
            None,
            512,
            self.meta,
            is_fp8_kvcache=True,
            indices=self.idx_buf,
        )

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one decode step (eager, or a graph replay once :meth:`capture` ran); returns ``(out, lse)``.

        Raises:
            RuntimeError: :meth:`prefill` was not called, or a context would exceed ``max_context``.
        """
        self._apply_table_updates(self._host_part())
        self._device_part()
        return self.out, self.lse

    def _host_part(self) -> list[tuple[int, int, int]]:
        if not self._allocated:
            raise RuntimeError("ServeSim.step: call prefill() first")
        if max(self.ctx_host) >= self.cfg.max_context:
            raise RuntimeError(f"ServeSim.step: a context would exceed max_context={self.cfg.max_context}")
        return self._grow_tables()

    def _device_part(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out, self.lse = self._step_body()
        self.ctx_host = [c + 1 for c in self.ctx_host]
        self.steps_done += 1

    def capture(self) -> None:
        """Capture the step in a CUDA graph (CUDA only; call after one eager :meth:`step`)."""
        if self.device.type != "cuda":
            raise RuntimeError("ServeSim.capture: CUDA graphs need a CUDA device")
        if not self.meta.have_initialized:
            raise RuntimeError("ServeSim.capture: run one eager step first (fills the scheduler metadata)")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.out, self.lse = self._step_body()
        torch.cuda.synchronize()
        self.graph = g

    # ---------------------------------------------------------------- the loop

    def run(self, progress: bool | RunProgress = True, stream: TextIO | None = None) -> dict:
        """Prefill, one warm-up step (+ capture), ``cfg.steps`` timed steps, then the check.

        Args:
            progress: report the run as it goes (its sizes first, then each phase and step with the
                elapsed time): ``True`` on ``stream`` (default stderr; a progress bar on a terminal,
                lines elsewhere, :func:`~sparse_mla.tools.progress.make_progress`), ``False`` for
                nothing, or a :class:`~sparse_mla.tools.progress.RunProgress` of the caller's.
            stream: where ``progress=True`` writes.

        Returns:
            A dict of the config and results: ``tokens_per_s``, ``p50_ms``/``p90_ms``/``p99_ms``/
            ``mean_ms`` per-step latency, ``graph`` (whether replayed from a CUDA graph),
            ``final_context_min``/``max``, ``check`` (dict, when enabled) and ``device_name``.
        """
        if isinstance(progress, RunProgress):
            rep = progress
        else:
            rep = make_progress(stream) if progress else RunProgress()
        try:
            return self._run(rep)
        finally:
            rep.close()

    def size_notes(self) -> list[str]:
        """What the run holds and does per step, in words (the first lines of its progress)."""
        cfg = self.cfg
        parts = self.memory_parts()
        what, (big, _) = max(parts.items(), key=lambda x: x[1][0])
        total = sum(b for b, _ in parts.values())
        notes = [
            f"{self.B} requests x topk {self.topk} = {self.B * self.topk:,} keys read per decode step "
            f"(h_q {cfg.h_q}); memory: at least {format_bytes(total)}, of which {what} {format_bytes(big)}"
        ]
        if self.topk > cfg.max_context:
            notes.append(
                f"topk {self.topk} > max_context {cfg.max_context}: at most {cfg.max_context} of each request's "
                f"{self.topk} indices are valid and the rest -1, which the decode still walks (its time grows "
                "with topk)"
            )
        return notes

    def _run(self, rep: RunProgress) -> dict:
        cuda = self.device.type == "cuda"
        for line in self.size_notes():
            rep.note(line)
        rep.begin("prefill")
        t0 = time.perf_counter()
        self.prefill()
        if cuda:
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        rep.end("prefill", f": {int(sum(self.ctx_host))} tokens")
        warm = "warm-up step"
        if cuda:
            warm += " (compiles the kernels" + (", captures a CUDA graph)" if self.use_graph else ")")
        rep.begin(warm)
        s = time.perf_counter()
        self.step()  # warm-up: compiles the kernels, fills the scheduler metadata
        if self.use_graph:
            self.capture()
        if cuda:
            torch.cuda.synchronize()
            rep.end(warm)
        else:  # a CPU step costs the same every time: the warm-up tells how long the run takes
            rest = format_seconds((time.perf_counter() - s) * self.cfg.steps)
            rep.end(warm, f"; {self.cfg.steps} timed steps at this pace: about {rest}")
        times = StepTimes()
        rep.steps(self.cfg.steps)
        for i in range(self.cfg.steps):
            if cuda:
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                new = self._host_part()  # block allocation on the host, before the timed region
                ev0.record()
                self._apply_table_updates(new)
                self._device_part()
                ev1.record()
                ev1.synchronize()
                dt = ev0.elapsed_time(ev1) * 1e-3
            else:
                s = time.perf_counter()
                self.step()
                dt = time.perf_counter() - s
            times.latencies.append(dt)
            rep.step(i + 1, self.cfg.steps, dt)
        lat_mean = sum(times.latencies) / len(times.latencies)
        res = dict(asdict(self.cfg))
        res.update(
            min_context=self.cfg.resolved_min_context(),
            device=str(self.device),
            device_name=torch.cuda.get_device_name(self.device) if cuda else "CPU",
            interpreter=os.environ.get("TRITON_INTERPRET", "0") == "1" and not cuda,
            graph=self.graph is not None,
            prefill_tokens=int(sum(self.ctx_host) - self.B * (self.cfg.steps + 1)),
            prefill_s=prefill_s,
            tokens_per_s=self.B / lat_mean,
            mean_ms=lat_mean * 1e3,
            p50_ms=times.percentile(50) * 1e3,
            p90_ms=times.percentile(90) * 1e3,
            p99_ms=times.percentile(99) * 1e3,
            final_context_min=min(self.ctx_host),
            final_context_max=max(self.ctx_host),
            latencies_ms=[x * 1e3 for x in times.latencies],
        )
        if self.cfg.check:
            rep.begin("check against the references")
            res["check"] = self.check_last_step()
            rep.end("check against the references", ": " + ("ok" if res["check"]["ok"] else "FAILED"))
        return res

    # ---------------------------------------------------------------- checks

    def check_last_step(self) -> dict:
        """Compare the last step with the references.

        Returns a dict: ``decode_ok`` (out/lse within FlashMLA's tolerances, docs/design.md §6, of
        :func:`~sparse_mla.reference.sparse_decode_reference` on the same cache and indices),
        ``out_max_abs_err``, ``out_cos_dist``, ``lse_max_abs_err``, ``store_ok`` (the last appended
        tokens' bytes equal :func:`~sparse_mla.quantize_k_cache` of their values),
        ``indices_ok`` (each request's valid indices are distinct, in its own blocks, and their
        count is ``min(topk, ctx)``), ``ok`` (all three).
        """
        from ..reference import sparse_decode_reference
        from ..testing import decode_closeness

        if self.device.type == "cuda":
            torch.cuda.synchronize()
        ro, rl = sparse_decode_reference(self.q_buf, self.k_cache, self.idx_buf, None, 512)
        c = decode_closeness(self.out, self.lse, ro, rl)
        store_ok = bool(torch.equal(self._slot_bytes(self.slot_buf.view(-1)), self._expected_bytes(self.kv_buf)))
        idx_ok = self._indices_ok()
        res = dict(
            decode_ok=c.ok,
            out_max_abs_err=c.out_max_abs_err,
            out_cos_dist=c.out_cos_dist,
            lse_max_abs_err=c.lse_max_abs_err,
            store_ok=store_ok,
            indices_ok=idx_ok,
            ok=c.ok and store_ok and idx_ok,
        )
        if self.cfg.indexer:
            res.update(self._check_indexer())
            res["ok"] = res["ok"] and res["indexer_logits_ok"] and res["indexer_topk_ok"]
        return res

    def _check_indexer(self) -> dict:
        """The last step's indexer against its twins: the logits within 2^-11 of the dot's terms on
        FP8 tensor cores (1e-5 elsewhere) of :func:`~sparse_mla.indexer.reference.fp8_paged_mqa_logits_reference`,
        and the slots the same set (row by row, ``-1`` in the same places) as the twin's top-k of the same
        logits through the block table."""
        from ..indexer.kernels import fp8_dot_supported
        from ..indexer.reference import fp8_paged_mqa_logits_reference, topk_indices_reference
        from ..kvcache.reference import abs_indices_to_kvcache_indices
        from ..testing import abs_e4m3, abs_index_cache, indexer_logits_closeness, same_index_sets

        args = (self.ctx, self.block_table, self.cfg.max_context)
        want = fp8_paged_mqa_logits_reference(self.iq_buf, self.index_cache, self.w_buf, *args)
        mag = fp8_paged_mqa_logits_reference(
            abs_e4m3(self.iq_buf), abs_index_cache(self.index_cache), self.w_buf.abs(), *args
        )
        tc = self.device.type == "cuda" and fp8_dot_supported(self.device) and self.cfg.index_dim >= 32
        logits_ok, max_err, _ = indexer_logits_closeness(self.logits, want, mag, tc)
        pos = topk_indices_reference(self.logits.cpu(), self.topk, None, self.ctx.cpu())
        slots = abs_indices_to_kvcache_indices(pos.view(self.B, 1, self.topk), self.block_table.cpu(), self.pbs)
        topk_ok = same_index_sets(self.idx_buf.view(self.B, self.topk), slots.view(self.B, self.topk))
        return dict(
            indexer_logits_ok=logits_ok,
            indexer_logits_max_abs_err=max_err,
            indexer_topk_ok=topk_ok,
        )

    def _slot_bytes(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored bytes of ``slots`` as ``[n, 576 + scale bytes]`` uint8 (data record, then scales)."""
        lay = self.lay
        raw = self.k_cache.view(torch.uint8)
        span = raw.untyped_storage().nbytes() - raw.storage_offset()
        flat = raw.as_strided((span,), (1,))
        s = slots.long()
        blk, off = s // self.pbs, s % self.pbs
        base = blk * raw.stride(0)
        if lay.name == "V32":
            at = (base + off * raw.stride(1)).unsqueeze(1) + torch.arange(lay.bytes_per_token, device=s.device)
        else:
            d = (base + off * lay.data_bytes).unsqueeze(1) + torch.arange(lay.data_bytes, device=s.device)
            sc = (base + self.pbs * lay.data_bytes + off * lay.scale_section_bytes).unsqueeze(1) + torch.arange(
                lay.scale_section_bytes, device=s.device
            )
            at = torch.cat([d, sc], dim=1)
        return flat[at]

    def _expected_bytes(self, kv: torch.Tensor) -> torch.Tensor:
        lay = self.lay
        q = quantize_k_cache(kv.view(-1, 1, 1, lay.d_qk), lay, out_dtype=torch.uint8)
        rows = q.as_strided((q.shape[0], lay.block_bytes(1)), (q.stride(0), 1))
        return (
            rows[:, : lay.bytes_per_token] if lay.name == "V32" else rows[:, : lay.data_bytes + lay.scale_section_bytes]
        )

    def _indices_ok(self) -> bool:
        idx = self.idx_buf.view(self.B, self.topk).cpu()
        table = self.block_table.cpu()
        for i, c in enumerate(self.ctx_host):
            row = idx[i]
            valid = row[row >= 0]
            if valid.numel() != min(self.topk, c) or torch.unique(valid).numel() != valid.numel():
                return False
            mine = set(table[i][table[i] >= 0].tolist())
            if not set((valid // self.pbs).tolist()) <= mine:
                return False
        return True
