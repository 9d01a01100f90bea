"""What every benchmark here shares: the measured ceilings, timing (eager and CUDA-graph replay),
the decode shapes with FlashMLA's times on the same GPU as data, the FLOP/byte model, inputs, and
results written as JSON (device, versions, commit, date) under ``benchmarks/results/``.

Run the benchmarks as modules from the repository root, with the package importable
(``pip install -e .`` or ``PYTHONPATH=src``): ``python -m benchmarks.decode``,
``python -m benchmarks.store``, ``python -m benchmarks.variants``, ``python -m benchmarks.profile``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton

import sparse_mla as flash_mla
from sparse_mla import get_layout

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CTX = 32768  # tokens of context per request
PBS = 64  # page_block_size


@dataclass(frozen=True)
class DecodeShape:
    """One decode benchmark row; ``flashmla_us``: FlashMLA 1.0 on the lent H200 (graph replay,
    docs/perf-log.md), None where FlashMLA has no kernel for the shape or it was not measured.

    ``flashmla_heads``: set when ``flashmla_us`` is FlashMLA's time at another head count, the one
    an engine pads ``h_q`` to (FlashMLA has no sparse decode kernel below 64 heads: a
    tensor-parallel slice of 8-32 heads runs as 64, the rows past ``h_q`` wasted)."""

    b: int
    h_q: int
    s_q: int
    topk: int
    d_qk: int
    flashmla_us: float | None = None
    ctx: int = CTX  # tokens of context per request (main cache)
    pbs: int = PBS  # page_block_size of the main cache
    extra_topk: int = 0  # indices per query into an extra cache (0: none)
    extra_pbs: int = PBS
    extra_len: bool = False  # random extra_topk_length in [1, extra_topk]
    topk_len: bool = False  # pass topk_length = topk (full: the same work as without it)
    flashmla_heads: int | None = None  # FlashMLA's time is at this many heads (h_q padded to it)


DECODE_SHAPES = [
    DecodeShape(128, 128, 2, 2048, 576, 366.5),
    DecodeShape(64, 128, 2, 2048, 576, 188.2),
    DecodeShape(2, 128, 2, 2048, 576, 25.6),
    DecodeShape(1, 128, 1, 2048, 576, 21.7),
    DecodeShape(128, 64, 2, 2048, 576, 229.0),
    DecodeShape(148, 128, 2, 16384, 576, 3133.0),
    DecodeShape(128, 32, 2, 2048, 576),
    DecodeShape(128, 16, 2, 2048, 576),
    # V3.2 with the features FlashMLA's Hopper kernel refuses: full topk_length (the same work as
    # the row without it), and 1024 + 1024 extra indices (the same attended count as topk 2048)
    DecodeShape(64, 128, 2, 2048, 576, 188.2, topk_len=True),
    DecodeShape(64, 128, 2, 1024, 576, extra_topk=1024),
    DecodeShape(64, 128, 2, 2048, 512),
    DecodeShape(64, 64, 2, 2048, 512),
    # MODEL1 as FlashMLA's tests run it in production: 16K-token caches with 256-token pages, top-k
    # 128 over them plus an extra cache (FlashMLA times from issue 11's table, same H200)
    DecodeShape(128, 128, 2, 128, 512, 207.1, ctx=16384, pbs=256, extra_topk=1024, extra_pbs=64),
    DecodeShape(128, 64, 2, 128, 512, 93.5, ctx=16384, pbs=256, extra_topk=512, extra_pbs=64),
    DecodeShape(128, 128, 2, 128, 512, 148.9, ctx=16384, pbs=256, extra_topk=1024, extra_pbs=2, extra_len=True),
    DecodeShape(148, 128, 2, 16384, 512, 2741.9, ctx=32768, pbs=256),
]


#: FlashMLA 1.0 at h_q = 64 (same H200, graph replay), the time an engine pays for a slice of
#: fewer heads padded to 64: V3.2 s_q 2, topk 2048 by b (b = 64 not measured), and MODEL1's
#: production shape (b 128, topk 128 + 512 extra in 64-token pages)
FLASHMLA_H64_V32_US = {2: 22.7, 128: 229.0}
FLASHMLA_H64_MODEL1_US = 93.5


def _padded(us: float | None, h_q: int) -> dict:
    """``flashmla_us`` (and, below 64 heads, ``flashmla_heads = 64``) of a small-head row."""
    return dict(flashmla_us=us, flashmla_heads=64 if us is not None and h_q < 64 else None)


#: The small-head table, small head counts (tensor-parallel slices): V3.2 at h_q 8/16/32/64 by b 2/64/128
#: (s_q 2, topk 2048, 32K contexts), and MODEL1's production shapes at h_q 16/32 (16K-token caches in
#: 256-token pages, topk 128 plus an extra cache of 512 indices, FlashMLA's h_q = 64 row, and of
#: 1024, the h_q = 128 row's extra). ``python -m benchmarks.decode --set small_heads``.
SMALL_HEAD_SHAPES = [
    DecodeShape(b, h_q, 2, 2048, 576, **_padded(FLASHMLA_H64_V32_US.get(b), h_q))
    for h_q in (8, 16, 32, 64)
    for b in (2, 64, 128)
] + [
    DecodeShape(128, h_q, 2, 128, 512, ctx=16384, pbs=256, extra_topk=extra, extra_pbs=64, **_padded(us, h_q))
    for h_q in (16, 32)
    for extra, us in ((512, FLASHMLA_H64_MODEL1_US), (1024, None))
]

#: the row sets ``benchmarks.decode --set`` selects from
SHAPE_SETS = {"default": DECODE_SHAPES, "small_heads": SMALL_HEAD_SHAPES}


def parse_filter(text: str | None) -> list[dict]:
    """``"b=64,h_q=128;b=1"`` -> ``[{"b": "64", "h_q": "128"}, {"b": "1"}]`` (a row matches if any
    filter matches all its keys; no filter matches everything)."""
    if not text:
        return [{}]
    return [dict(kv.split("=") for kv in part.split(",") if kv) for part in text.split(";")]


def matches(shape, flt: dict) -> bool:
    """Whether every ``key=value`` of the filter ``flt`` holds for ``shape``'s fields (as text)."""
    return all(str(getattr(shape, k)) == v for k, v in flt.items())


def select(shapes: list, only: str | None) -> list:
    """The rows of ``shapes`` (dataclasses) that a filter of ``only`` (:func:`parse_filter`) matches."""
    filters = parse_filter(only)
    return [s for s in shapes if any(matches(s, f) for f in filters)]


# ---------------------------------------------------------------------------------- measurement


def median_us(fn: Callable[[], object], quick: bool = False) -> float:
    """Median µs of ``fn`` (``triton.testing.do_bench``: CUDA events, L2 flushed between calls)."""
    return 1e3 * triton.testing.do_bench(
        fn, warmup=25 if quick else 100, rep=100 if quick else 500, return_mode="median"
    )


def capture_graphs(make_call: Callable[[int], Callable[[], object]], n_variants: int) -> list:
    """One CUDA graph per input variant: ``make_call(i)`` returns the call to capture for variant
    ``i`` (run once outside the capture first, to compile)."""
    graphs = []
    for i in range(n_variants):
        fn = make_call(i)
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    return graphs


def graph_replay_us(make_call: Callable[[int], Callable[[], object]], n_variants: int, quick: bool = False) -> float:
    """Median µs of replaying one CUDA graph per input variant, in rotation (as an engine replays
    its decode graph): ``make_call(i)`` returns the call to capture for variant ``i``."""
    graphs = capture_graphs(make_call, n_variants)
    state = {"i": 0}

    def replay():
        graphs[state["i"] % n_variants].replay()
        state["i"] += 1

    replay()
    torch.cuda.synchronize()
    return median_us(replay, quick)


def has_cuda(name: str) -> bool:
    """True with a CUDA device; else says on stderr that benchmark ``name`` needs one."""
    if torch.cuda.is_available():
        return True
    print(f"{name}: needs a CUDA device", file=sys.stderr)
    return False


def ceilings() -> tuple[float, float]:
    """Measured bf16 matmul TFLOP/s (8192³) and device-copy GB/s (read + write of 2 GiB)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    bm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * 8192**3 / (median_us(lambda: a @ bm) * 1e-6) / 1e12
    return tflops, copy_ceiling_gbs()


def copy_ceiling_gbs() -> float:
    """Measured device-copy GB/s (read + write) of a 2 GiB buffer."""
    src = torch.empty(1024**3, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (median_us(lambda: dst.copy_(src)) * 1e-6) / 1e9


def environment() -> dict:
    """Device, versions, commit and date of a run (stored with every result file)."""
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(RESULTS_DIR),
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        sparse_mla=flash_mla.__version__,
        commit=commit,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def write_results(name: str, payload: dict, path: str | None = None) -> str:
    """Write ``payload`` plus :func:`environment` as JSON to ``path`` (default
    ``benchmarks/results/<date>_<device>_<name>.json``); returns the path."""
    env = environment()
    if path is None:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        dev = "".join(c if c.isalnum() else "-" for c in env["device"]).strip("-").lower()
        path = os.path.join(RESULTS_DIR, f"{env['date'][:10]}_{dev}_{name}.json")
    with open(path, "w") as f:
        json.dump(dict(benchmark=name, **env, **payload), f, indent=1)
    return path


# ---------------------------------------------------------------------------------- decode model


def decode_flops(s: DecodeShape, extra_attended: float | None = None) -> int:
    """``2 · b · s_q · h_q · (topk + extra) · (d_qk + d_v)``; ``extra``: mean attended extra indices
    per query (default ``extra_topk``)."""
    extra = s.extra_topk if extra_attended is None else extra_attended
    return int(2 * s.b * s.s_q * s.h_q * (s.topk + extra) * (s.d_qk + 512))


@dataclass
class DecodeInputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    index_sets: list  # several [b, s_q, topk] index tensors, rotated so the touched bytes exceed L2
    unique_tokens: float  # mean distinct cache tokens a call reads
    extra_k_cache: torch.Tensor | None = None
    extra_sets: list | None = None  # [b, s_q, extra_topk] per index set
    extra_topk_length: torch.Tensor | None = None
    topk_length: torch.Tensor | None = None

    def bytes_moved(self, s: DecodeShape) -> float:
        """Cache bytes of the distinct tokens read, plus q, out (bf16) and lse (fp32)."""
        return self.cache_bytes(s) + self.q.numel() * 2 + s.b * s.s_q * s.h_q * (512 * 2 + 4)

    def cache_bytes(self, s: DecodeShape) -> float:
        """Unique gathered cache bytes of a call: the distinct cache tokens its index set reads
        (main and extra cache; a token indexed by several query tokens or requests counts once;
        mean over the rotated sets) times the layout's bytes per token (656 V32, 584 MODEL1 with
        its scale bytes). The floor of what a call must read from HBM, whatever the head count."""
        return self.unique_tokens * get_layout(s.d_qk).bytes_per_token

    def extra_attended(self) -> float:
        """Mean extra indices a query attends (``extra_topk_length`` when given)."""
        if self.extra_sets is None:
            return 0.0
        if self.extra_topk_length is None:
            return float(self.extra_sets[0].shape[2])
        return float(self.extra_topk_length.float().mean())

    def call_kwargs(self, i: int) -> dict:
        """The index arguments of ``flash_mla_with_kvcache`` for index set ``i`` (rotating)."""
        kw = dict(indices=self.index_sets[i % len(self.index_sets)])
        if self.topk_length is not None:
            kw["topk_length"] = self.topk_length
        if self.extra_sets is not None:
            kw.update(
                extra_k_cache=self.extra_k_cache,
                extra_indices_in_kvcache=self.extra_sets[i % len(self.extra_sets)],
                extra_topk_length=self.extra_topk_length,
            )
        return kw


def _paged_cache(b: int, ctx: int, pbs: int, lay, g: torch.Generator, device: str):
    """A paged FP8 cache of ``b`` requests of ``ctx`` tokens (blocks shuffled): (cache, block_table)."""
    nblk_per = -(-ctx // pbs)
    total_blocks = b * nblk_per
    # quantising millions of random tokens takes long: quantise a pool of distinct tokens and tile
    # it, so every slot holds a valid record
    pool_blocks = max(1, 65536 // pbs)
    k = torch.randn(pool_blocks, pbs, 1, lay.d_qk, device=device, generator=g).to(torch.bfloat16)
    pool = flash_mla.quantize_k_cache(k, lay).view(torch.uint8)
    bb = lay.block_bytes(pbs)
    flat = torch.empty(total_blocks, bb, dtype=torch.uint8, device=device)
    src = pool.as_strided((pool.shape[0], bb), (pool.stride(0), 1))
    for start in range(0, total_blocks, src.shape[0]):
        n = min(src.shape[0], total_blocks - start)
        flat[start : start + n] = src[:n]
    kc = flat.as_strided((total_blocks, pbs, 1, lay.bytes_per_token), (bb, lay.bytes_per_token, lay.bytes_per_token, 1))
    block_table = torch.randperm(total_blocks, device=device, generator=g).view(b, nblk_per).int()
    return kc, block_table


def _index_sets(b: int, s_q: int, ctx: int, topk: int, pbs: int, table, n_sets: int, g, device: str) -> list:
    sets = []
    for _ in range(n_sets):
        pos = torch.rand(b * s_q, ctx, device=device, generator=g).argsort(dim=1)[:, :topk]
        sets.append(flash_mla.abs_indices_to_kvcache_indices(pos.view(b, s_q, topk).int(), table, pbs))
    return sets


def decode_inputs(s: DecodeShape, seed: int = 0, device: str = "cuda") -> DecodeInputs:
    """A paged FP8 cache of ``b`` requests with ``s.ctx``-token contexts (blocks shuffled), random q
    and several sets of random distinct top-k positions per query token, as cache indices (on
    ``device``); with ``s.extra_topk``, an extra cache of the same shape (its own page size) and
    index sets into it."""
    lay = get_layout(s.d_qk)
    per_call_bytes = s.b * s.s_q * (s.topk + s.extra_topk) * lay.bytes_per_token
    n_sets = max(2, min(16, int(4 * 60e6 // per_call_bytes) + 1))  # >= ~4x L2 touched in rotation
    g = torch.Generator(device=device).manual_seed(seed)
    kc, table = _paged_cache(s.b, s.ctx, s.pbs, lay, g, device)
    q = torch.randn(s.b, s.s_q, s.h_q, s.d_qk, device=device, generator=g).to(torch.bfloat16)
    sets = _index_sets(s.b, s.s_q, s.ctx, s.topk, s.pbs, table, n_sets, g, device)
    uniq = sum(_distinct_tokens(ix) for ix in sets) / n_sets
    inp = DecodeInputs(q, kc, sets, uniq)
    if s.topk_len:
        inp.topk_length = torch.full((s.b,), s.topk, dtype=torch.int32, device=device)
    if s.extra_topk:
        ekc, etable = _paged_cache(s.b, s.ctx, s.extra_pbs, lay, g, device)
        inp.extra_k_cache = ekc
        inp.extra_sets = _index_sets(s.b, s.s_q, s.ctx, s.extra_topk, s.extra_pbs, etable, n_sets, g, device)
        if s.extra_len:
            inp.extra_topk_length = torch.randint(
                1, s.extra_topk + 1, (s.b,), device=device, generator=g, dtype=torch.int64
            ).int()
        inp.unique_tokens += sum(_distinct_tokens(ix, inp.extra_topk_length) for ix in inp.extra_sets) / n_sets
    return inp


def _distinct_tokens(indices: torch.Tensor, lengths: torch.Tensor | None = None) -> int:
    """Distinct cache tokens that ``[b, s_q, topk]`` indices make a call read: valid ones, and
    with ``lengths`` only positions below ``lengths[b]`` (the kernels load nothing past it)."""
    keep = indices >= 0
    if lengths is not None:
        pos = torch.arange(indices.shape[-1], device=indices.device)
        keep &= pos.view(1, 1, -1) < lengths.view(-1, 1, 1)
    return int(torch.unique(indices[keep]).numel())


def as_dict(obj) -> dict:
    return asdict(obj)
