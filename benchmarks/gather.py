"""The random-gather ceiling of the decode's cache reads: how fast a kernel that does nothing but
read the gathered tokens can go, on the same cache and the same index sets as a decode row.

    python -m benchmarks.gather [--quick] [--only b=128,h_q=16] [--tma STAGES] [--json PATH]

The sparse decode reads, per query token, ``topk`` whole cache records (656 bytes for V32, 584 for
MODEL1) at random slots of its request's pages. The decode's target is >= 75 % of the device-copy
bandwidth on those bytes; this measures what a gather alone reaches, so a decode row's GB/s can be
read against both ceilings (the copy's and the gather's). The kernel (``_gather_max_kernel``) loads
each indexed record as int32 words (16-byte vectors, 64 records a program, many programs a SM, no
shared memory, no conversion) and stores one max per program; its twin is
:func:`gather_max_reference`. ``--tma`` adds the same gather by the tensor-memory accelerator
(:func:`gather_max_tma`, Hopper, 656-byte V32 records): no L1, no registers between HBM and shared
memory, the question being whether it beats the 16-byte loads' ceiling; its GB/s count the 656
useful bytes of a record, the copies move 768 (two power-of-two boxes; 112 B of the next record).
Rows: the decode row's own index sets (rotated past L2, as
:func:`benchmarks.harness.decode_inputs` builds them), the same number of records at random slots
of a 32 MB window (L2-resident), and consecutive slots (a streaming read).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from sparse_mla.core.launcher import carveout_hint, launch
from sparse_mla.decode.kernels.hopper import _cta_barrier
from sparse_mla.formats import cache_bytes

from . import harness

BLOCK_T = 64  # records per program


@triton.jit
def _gather_max_kernel(
    cache_ptr, stride_blk, stride_tok, n_slots, idx_ptr, n, out_ptr, PBS: tl.constexpr, WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Program ``p``: the max over the int32 words of records ``idx[64 p .. 64 p + 63]`` (slot
    ``s`` at byte ``(s // PBS) * stride_blk + (s % PBS) * stride_tok``; outside ``[0, n_slots)``: skipped)."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    idx = tl.load(idx_ptr + t, mask=t < n, other=-1)
    valid = (idx >= 0) & (idx < n_slots)
    s = tl.where(valid, idx, 0)
    base = (s // PBS).to(tl.int64) * stride_blk + (s % PBS).to(tl.int64) * stride_tok
    base = tl.multiple_of(base, 16)
    w = tl.arange(0, BLOCK_W)
    ptr = (cache_ptr + base[:, None]).to(tl.pointer_type(tl.int32)) + w[None, :]
    x = tl.load(ptr, mask=valid[:, None] & (w[None, :] < WORDS), other=-(2**31))
    tl.store(out_ptr + pid, tl.max(tl.max(x, axis=1), axis=0))


def _flat_indices_and_out(indices: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flattened contiguous indices and the ``[ceil(n / 64)]`` int32 result (made, or ``out``
    checked: ``ValueError`` unless contiguous int32 of that length on the indices' device)."""
    idx = indices.reshape(-1).contiguous()
    groups = triton.cdiv(idx.numel(), BLOCK_T)
    if out is None:
        out = torch.empty(groups, dtype=torch.int32, device=idx.device)
    elif (
        out.dtype != torch.int32 or tuple(out.shape) != (groups,) or not out.is_contiguous() or out.device != idx.device
    ):
        raise ValueError(
            f"out: expected a contiguous int32 [{groups}] on {idx.device}, got {out.dtype} {list(out.shape)}"
        )
    return idx, out


def gather_max(
    k_cache: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None = None, carveout: int = -1
) -> torch.Tensor:
    """Per 64 indices (flattened ``indices``, int32 slots; ``-1`` and slots past the cache's
    ``num_blocks * page_block_size`` skipped): the max int32 word of
    their records in ``k_cache`` (a paged FP8 cache ``[num_blocks, page_block_size, 1, bytes]``,
    records a multiple of 16 bytes at 16-byte aligned addresses). Returns int32 ``[ceil(n / 64)]``;
    a group with no valid index gives ``-2**31``. ``carveout``: the shared-memory carveout hint
    (percent, -1: the driver's default; :func:`sparse_mla.core.launcher.set_smem_carveout`), set
    before the launch.

    Raises:
        ValueError: ``k_cache`` not ``[num_blocks, page_block_size, 1, bytes]`` with unit byte stride
            and 16-byte records and strides; ``out`` not a contiguous int32 ``[ceil(n / 64)]`` on the
            indices' device.
    """
    raw = cache_bytes(k_cache)
    if raw.dim() != 4 or raw.shape[2] != 1 or raw.stride(3) != 1:
        raise ValueError(
            f"k_cache: expected [num_blocks, page_block_size, 1, bytes] with unit byte stride, got shape "
            f"{list(raw.shape)} strides {tuple(raw.stride())}"
        )
    rec = raw.shape[-1]
    if rec % 16 or raw.stride(1) % 16 or raw.stride(0) % 16 or raw.data_ptr() % 16:
        raise ValueError(f"k_cache: records of {rec} bytes at strides {tuple(raw.stride())}: expected multiples of 16")
    idx, out = _flat_indices_and_out(indices, out)
    n = idx.numel()
    grid = (out.shape[0],)
    words = rec // 4
    launch(
        _gather_max_kernel, (grid[0], 1, 1), (raw, raw.stride(0), raw.stride(1), raw.shape[0] * raw.shape[1], idx, n, out),
        dict(PBS=raw.shape[1], WORDS=words, BLOCK_T=BLOCK_T, BLOCK_W=triton.next_power_of_2(words)),
        {"num_warps": 4}, carveout_hint(carveout),
    )  # fmt: skip
    return out


# Gluon's shared-memory reinterpret is ``_reinterpret`` in Triton 3.6, ``reinterpret`` in 3.9
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
# the tensor-memory copy into shared memory (``async_load`` in newer Gluon)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
REC_ROWS = gl.constexpr(41)  # 16-byte rows of a 656-byte V32 record
REC_BOX_BYTES = gl.constexpr((32 + 16) * 16)  # a record's two boxes: 512 B of NoPE, 256 B from its scales on
LOADERS = gl.constexpr(4)  # loader warps: each issues 16 records' copies a group


@gluon.jit
def _my_groups(n):
    """``(program, programs, groups of 64 indices this program takes)``: groups ``pid, pid + g, ...``."""
    pid = gl.program_id(0)
    g = gl.num_programs(0)
    return pid, g, gl.cdiv(gl.cdiv(n, 64) - pid, g)


@gluon.jit
def _tma_loader(
    nope_desc, tail_desc, nope, tail, ready, empty, idx_ptr, n, n_slots, PBS: gl.constexpr, PART: gl.constexpr
):
    """Loader warp ``PART`` of :func:`_gather_max_tma_kernel`: per group of 64 indices, its 16
    records (``16 PART ..``), two copies a record (rows ``[0, 32)`` and ``[32, 48)`` of its 16-byte
    rows; the second box runs 112 bytes into the next record, or past the block where the copy
    fills zeros) into a free stage; an index outside ``[0, n_slots)`` copies slot 0 (the reader
    skips it). Four loaders keep four index loads in flight (one warp issues its copies in turn,
    each after its index arrives)."""
    PER: gl.constexpr = 64 // LOADERS
    NS: gl.constexpr = ready.shape[0]
    pid, g, mine = _my_groups(n)
    for j in range(mine):
        stage = j % NS
        mbarrier.wait(empty.index(stage), ((j // NS) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, PER * REC_BOX_BYTES)  # (an arrive: `ready` counts the loaders)
        grp = pid + j * g
        for tt in gl.static_range(PER):
            t = PART * PER + tt
            i = grp * 64 + t
            s = gl.load(idx_ptr + i, mask=i < n, other=-1)
            s = gl.where((s >= 0) & (s < n_slots), s, 0)
            row = (s % PBS) * REC_ROWS
            _tma_load(nope_desc, [s // PBS, row, 0], bar, nope.index(stage * 64 + t))
            _tma_load(tail_desc, [s // PBS, row + 32, 0], bar, tail.index(stage * 64 + t))


@gluon.jit
def _tma_reader(nope, tail, ready, empty, idx_ptr, n, n_slots, out_ptr):
    """The reader warps of :func:`_gather_max_tma_kernel`: per landed group, the max int32 word of
    its valid records (the NoPE box's 128 words and the first 36 of the second box's 64), then the
    stage goes back to the loader."""
    NS: gl.constexpr = ready.shape[0]
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    if _PUBLIC_REINTERPRET:
        nope_w = nope.reinterpret(gl.int32, [NS, 64, 128], PLAIN)
        tail_w = tail.reinterpret(gl.int32, [NS, 64, 64], PLAIN)
    else:
        nope_w = nope._reinterpret(gl.int32, [NS, 64, 128], PLAIN)
        tail_w = tail._reinterpret(gl.int32, [NS, 64, 64], PLAIN)
    LN: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    pid, g, mine = _my_groups(n)
    for j in range(mine):
        stage = j % NS
        mbarrier.wait(ready.index(stage), (j // NS) & 1)
        grp = pid + j * g
        tok = grp * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, LN))
        s = gl.load(idx_ptr + tok, mask=tok < n, other=-1)
        ok = gl.expand_dims((s >= 0) & (s < n_slots), 1)
        w = nope_w.index(stage).load(LN)
        m = gl.max(gl.max(gl.where(ok, w, -2147483648), axis=1), axis=0)
        col = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, LN)), 0)
        wt = tail_w.index(stage).load(LN)
        mt = gl.max(gl.max(gl.where(ok & (col < REC_ROWS * 4 - 128), wt, -2147483648), axis=1), axis=0)
        gl.store(out_ptr + grp, gl.maximum(m, mt))
        _cta_barrier()  # every reader's loads of the stage before it is released
        mbarrier.arrive(empty.index(stage), count=1)


@gluon.jit
def _gather_max_tma_kernel(nope_desc, tail_desc, idx_ptr, n, n_slots, out_ptr, PBS: gl.constexpr, NS: gl.constexpr):
    """:func:`_gather_max_kernel`'s result with the records brought by tensor-memory copies into an
    ``NS``-stage ring (48 KB a stage): four loader warps issue, four reader warps reduce; grid-stride
    over the groups (by default one program per SM)."""
    L3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
    nope = gl.allocate_shared_memory(gl.uint8, [NS * 64, 1, 32, 16], L3)
    tail = gl.allocate_shared_memory(gl.uint8, [NS * 64, 1, 16, 16], L3)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=LOADERS)
        mbarrier.init(empty.index(i), count=1)
    gl.static_assert(LOADERS == 4, "the partitions below are written out for four loaders")
    gl.warp_specialize(
        [
            (_tma_reader, (nope, tail, ready, empty, idx_ptr, n, n_slots, out_ptr)),
            (_tma_loader, (nope_desc, tail_desc, nope, tail, ready, empty, idx_ptr, n, n_slots, PBS, 0)),
            (_tma_loader, (nope_desc, tail_desc, nope, tail, ready, empty, idx_ptr, n, n_slots, PBS, 1)),
            (_tma_loader, (nope_desc, tail_desc, nope, tail, ready, empty, idx_ptr, n, n_slots, PBS, 2)),
            (_tma_loader, (nope_desc, tail_desc, nope, tail, ready, empty, idx_ptr, n, n_slots, PBS, 3)),
        ],
        [1, 1, 1, 1],
        [48, 48, 48, 48],
    )


def tma_descriptors(k_cache: torch.Tensor) -> tuple:
    """The two host descriptors of :func:`gather_max_tma` over a V32 cache's bytes, seen as
    ``[num_blocks, page_block_size * 41, 16]`` (16-byte rows; any 16-byte block stride).

    Raises:
        ValueError: not 656-byte records at a 656-byte token stride, or a block stride or start
            that is not a multiple of 16 bytes.
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    raw = cache_bytes(k_cache)
    if raw.dim() != 4 or raw.shape[2] != 1 or raw.shape[3] != 656 or raw.stride(1) != 656 or raw.stride(3) != 1:
        raise ValueError(
            f"k_cache: expected V32 records [num_blocks, page_block_size, 1, 656] at a 656-byte token stride, got "
            f"shape {list(raw.shape)} strides {tuple(raw.stride())}"
        )
    if raw.stride(0) % 16 or raw.data_ptr() % 16:
        raise ValueError(f"k_cache: block stride {raw.stride(0)} and start must be multiples of 16 bytes")
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
    shape = [raw.shape[0], raw.shape[1] * REC_ROWS.value, 16]
    strides = [raw.stride(0), 16, 1]
    return (
        TensorDescriptor(raw, shape, strides, [1, 32, 16], layout),
        TensorDescriptor(raw, shape, strides, [1, 16, 16], layout),
    )


def gather_max_tma(
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor | None = None,
    stages: int = 4,
    descs=None,
    programs: int | None = None,
) -> torch.Tensor:
    """:func:`gather_max` (V32 caches only) with the records brought by tensor-memory copies
    (:func:`_gather_max_tma_kernel`; sm_90+, not under the interpreter). ``stages``: ring depth
    (48 KB each, at most 4); ``descs``: :func:`tma_descriptors` of ``k_cache``, made here when None;
    ``programs``: the grid (default one program per SM, at most one per group of 64 indices).

    Raises:
        ValueError: ``stages`` outside 1..4 or ``programs`` < 1; ``indices`` not int32 on the cache's
            CUDA device; ``out`` not a contiguous int32 ``[ceil(n / 64)]`` there; ``k_cache`` as
            :func:`tma_descriptors` refuses it.
    """
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= 4:
        raise ValueError(f"stages: expected an int in 1..4 (48 KB of shared memory each), got {stages!r}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs: expected an int >= 1 or None, got {programs!r}")
    if indices.dtype != torch.int32 or indices.device != k_cache.device or k_cache.device.type != "cuda":
        raise ValueError(
            f"indices: expected int32 on the cache's CUDA device, got {indices.dtype} on {indices.device} "
            f"(cache on {k_cache.device})"
        )
    nope_desc, tail_desc = descs or tma_descriptors(k_cache)
    raw = cache_bytes(k_cache)
    idx, out = _flat_indices_and_out(indices, out)
    n = idx.numel()
    groups = out.shape[0]
    if groups == 0:
        return out
    programs = min(groups, programs or torch.cuda.get_device_properties(idx.device).multi_processor_count)
    _gather_max_tma_kernel[(programs,)](
        nope_desc, tail_desc, idx, n, raw.shape[0] * raw.shape[1], out, PBS=raw.shape[1], NS=stages, num_warps=4
    )
    return out


def gather_max_reference(k_cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`gather_max` in PyTorch."""
    raw = cache_bytes(k_cache)
    pbs = raw.shape[1]
    idx = indices.reshape(-1).long().cpu()
    n = idx.numel()
    words = torch.full((triton.cdiv(n, BLOCK_T) * BLOCK_T, raw.shape[-1] // 4), -(2**31), dtype=torch.int32)
    valid = (idx >= 0) & (idx < raw.shape[0] * pbs)
    s = idx[valid]
    recs = raw.cpu()[s // pbs, s % pbs, 0].contiguous().view(torch.int32)
    words[:n][valid] = recs
    return words.view(-1, BLOCK_T * words.shape[1]).amax(dim=1).to(indices.device)


def rows_for(s: harness.DecodeShape, quick: bool, carveouts: list[int], tma_stages: int = 0) -> list[dict]:
    """The three gather rows (µs, GB/s on the gathered bytes) for one decode shape, at each of the
    shared-memory carveout hints ``carveouts`` (percent, -1: the driver's default), and with
    ``tma_stages`` > 0 the same three by :func:`gather_max_tma` with that many stages (carveout
    ``"tma"``); the shape's cache and index sets are built once for all of them."""
    inp = harness.decode_inputs(s)
    rec = cache_bytes(inp.k_cache).shape[-1]
    n = inp.index_sets[0].numel()
    slots = inp.k_cache.shape[0] * inp.k_cache.shape[1]
    g = torch.Generator(device="cuda").manual_seed(1)
    window = max(BLOCK_T, min(slots, (32 << 20) // rec))
    cases = {
        "decode index sets": inp.index_sets,
        "32 MB window": [torch.randint(0, window, (n,), device="cuda", generator=g, dtype=torch.int32)],
        "consecutive slots": [torch.arange(n, device="cuda", dtype=torch.int32) % slots],
    }
    out = torch.empty(triton.cdiv(n, BLOCK_T), dtype=torch.int32, device="cuda")
    rows = []
    descs = tma_descriptors(inp.k_cache) if tma_stages else None
    for carveout in [*carveouts, *(["tma"] if tma_stages else [])]:
        for name, sets in cases.items():
            state = {"i": 0}

            def call(sets=sets, state=state, carveout=carveout):
                state["i"] += 1
                if carveout == "tma":
                    return gather_max_tma(inp.k_cache, sets[state["i"] % len(sets)], out, tma_stages, descs)
                return gather_max(inp.k_cache, sets[state["i"] % len(sets)], out, carveout)

            us = harness.median_us(call, quick)
            valid = sum(int((ix >= 0).sum()) for ix in sets) / len(sets)
            gbs = valid * rec / (us * 1e-6) / 1e9
            rows.append(dict(harness.as_dict(s), case=name, carveout=carveout, us=us, gbs=gbs, records=valid))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="b=128,h_q=16,d_qk=576;b=64,h_q=16,d_qk=576", help="small_heads rows k=v,k=v;...")
    ap.add_argument("--json", help="write the results here (default: benchmarks/results/<date>_<gpu>_gather.json)")
    ap.add_argument(
        "--carveout",
        type=int,
        action="append",
        default=None,
        help="shared-memory carveout hints to run (percent; -1: the driver's default; 100: the most shared "
        "memory, the L1 a kernel past 48 KB gets from Triton); repeatable, default -1",
    )
    ap.add_argument(
        "--tma",
        type=int,
        default=0,
        metavar="STAGES",
        help="also the tensor-memory gather (gather_max_tma) with this many 48 KB stages (Hopper, V32)",
    )
    a = ap.parse_args(argv)
    if not harness.has_cuda("benchmarks.gather"):
        return 2
    copy = harness.copy_ceiling_gbs()
    print(f"# device copy {copy:.0f} GB/s")
    rows = []
    for s in harness.select(harness.SMALL_HEAD_SHAPES, a.only):
        for r in rows_for(s, a.quick, a.carveout or [-1], a.tma):
            r["pct_copy"] = 100 * r["gbs"] / copy
            rows.append(r)
            print(
                f"b={r['b']} s_q={r['s_q']} topk={r['topk']} d_qk={r['d_qk']} carveout={r['carveout']} {r['case']:18s} "
                f"{r['us']:8.1f} us {r['gbs']:7.0f} GB/s {r['pct_copy']:5.1f} % of copy",
                flush=True,
            )
        torch.cuda.empty_cache()
    print(f"results: {harness.write_results('gather', dict(quick=a.quick, copy_gbs=copy, rows=rows), a.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
