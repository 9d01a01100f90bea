"""Producer microbenchmark for issue 11's h_q 128 route (Triton >= 3.8; ``compile`` offline,
``run`` on an sm_90 GPU). Prepared in session 9; run in session 10 (H200, Triton 3.8.0,
``benchmarks/results/2026-12-01_nvidia-h200_cluster_probes_session10.txt``): **solo 180.6 µs, pair
295.0 µs** for 62 blocks, both delivering the right tiles. Sharing the conversion through
per-thread ``st.async`` (16 B per instruction, half of it to the peer's smem) costs more than the
half of the gather and conversion it saves; the first run hung (a ``[2, 2]`` release token is
replicated over the 128 threads and ``async_store`` stores every replica, so ``empty`` got 128x
its bytes).

Question: does sharing the block's conversion between the two CTAs of a head pair halve the
producer's time? At b=64/h_q=128 our producer alone takes 188 µs, FlashMLA's whole kernel 188.

* ``solo``: 132 CTAs (one per SM), each gathers the 64 tokens of each of ``nblk`` blocks (V3.2 FP8
  records, 656 B: 512 e4m3 bytes, 4 fp32 scales), converts them to bf16 and stores the
  ``[64, 4, 128]`` tile into its 2-stage ring (what each of the pair's CTAs does today);
* ``pair``: 66 clusters of 2 CTAs: CTA r gathers and converts rows ``[32r, 32r + 32)`` of each block
  and stores them into both CTAs' stage with one ``hopper.async_store`` (destination ``[2, 64, 4,
  128]`` held per CTA, value split over the CTAs on the rows: ``cluster_async_store_probe.py``);
  ``ready`` expects the whole tile; consumers release a stage to both producers with one int32 per
  thread ``async_store``d onto each CTA's ``empty`` (``cluster_ring_probe.py``).

Both deliver the same tiles to the same 132 rings. A consumer partition only waits and releases
(no MMA), so the time is the producers'. ``run`` also checks that each CTA's copy of the last tile
equals the dequantised cache rows.

    python docs/experiments/cluster_producer_bench.py compile
    python docs/experiments/cluster_producer_bench.py run [nblk]
"""

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import cluster, fence_async_shared, mbarrier

REC = gl.constexpr(656)  # V3.2 record bytes

# ---- pair (num_ctas=2) layouts: module scope (cga_layout) --------------------------------------
P4: gl.constexpr = gl.BlockedLayout(
    [2, 1, 1, 16], [1, 8, 1, 4], [1, 4, 1, 1], [3, 2, 1, 0], cga_layout=[[0, 1, 0, 0]]
)  # [destination CTA, row, 16-B group, byte]: rows split over the CTAs
P3: gl.constexpr = gl.SliceLayout(0, P4)  # the rows this CTA converts
PS: gl.constexpr = gl.NVMMASharedLayout(
    swizzle_byte_width=128, element_bitwidth=16, rank=4, cga_layout=[[1, 0, 0, 0]]
)  # a stage [2, 64, 4, 128]: CTA d holds [d]
PR: gl.constexpr = gl.BlockedLayout(
    [1, 1, 1, 8], [1, 8, 1, 4], [1, 4, 1, 1], [3, 2, 1, 0], cga_layout=[[1, 0, 0, 0]]
)  # reading this CTA's copy
# the release token [destination CTA, 256]: one int32 per consumer thread and destination (async_store
# stores every replica of a replicated element, each completing its bytes on the barrier again)
PE: gl.constexpr = gl.BlockedLayout([2, 1], [1, 32], [1, 4], [1, 0], cga_layout=[[0, 1]])
PES: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0], cga_layout=[[1, 0]])
# ---- solo (num_ctas=1) layouts ------------------------------------------------------------------
S3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 1, 4], [4, 1, 1], [2, 1, 0])
SS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
SR: gl.constexpr = gl.BlockedLayout([1, 1, 8], [8, 1, 4], [4, 1, 1], [2, 1, 0])


@gluon.jit
def _gather(cache, idx_ptr, n_tok, L3: gl.constexpr):
    """The block's NoPE bytes ``[64, 4, 128]`` and its 4 scales per token, in layout ``L3`` (the
    pair's layout gives each CTA its 32 rows); invalid indices read nothing (zeros)."""
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    idx = gl.load(idx_ptr + rows)
    ok = (idx >= 0) & (idx < n_tok)
    tok = gl.where(ok, idx, 0).to(gl.int64) * REC
    tok3 = gl.expand_dims(gl.expand_dims(tok, 1), 2)
    off = gl.expand_dims(gl.expand_dims(t, 0), 2) * 128 + gl.expand_dims(gl.expand_dims(c, 0), 1)
    raw = gl.load(cache + tok3 + off, mask=gl.expand_dims(gl.expand_dims(ok, 1), 2), other=0)
    sp = (cache + gl.expand_dims(tok, 1) + 512).to(gl.pointer_type(gl.float32))
    sc = gl.load(sp + gl.expand_dims(t, 0), mask=gl.expand_dims(ok, 1), other=0.0)
    return (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(sc, 2)).to(gl.bfloat16)


@gluon.jit
def _pair_producer(cache, idx_ptr, n_tok, nblk, ring, ready, empty):
    cid = gl.program_id(0)
    for j in range(nblk):
        stage = j % 2
        kv = _gather(cache, idx_ptr + (cid * nblk + j).to(gl.int64) * 64, n_tok, P3)
        if j >= 2:  # both consumers released this stage (block j - 2): 512 bytes from each
            mbarrier.expect(empty.index(stage), 1024)
            mbarrier.wait(empty.index(stage), ((j - 2) // 2) & 1)
        mbarrier.expect(ready.index(stage), 64 * 512 * 2)
        hopper.async_store(ring.index(stage), gl.expand_dims(kv, 0).broadcast_to([2, 64, 4, 128]), ready.index(stage))


@gluon.jit
def _pair_consumer(nblk, ring, esig, ready, empty, out):
    token = gl.full([2, 256], 1, gl.int32, PE)
    for j in range(nblk):
        stage = j % 2
        mbarrier.wait(ready.index(stage), (j // 2) & 1)
        if j + 2 < nblk:
            hopper.async_store(esig.index(stage), token, empty.index(stage))
    last = ring.index((nblk - 1) % 2).load(PR)  # [2, 64, 4, 128]: this CTA's copy
    d = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, PR))))
    r = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, PR))))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, PR))))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, PR))))
    cta = gl.program_id(0) * 2 + d
    base = (
        gl.expand_dims(gl.expand_dims(gl.expand_dims(cta, 1), 2), 3) * 64
        + gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 0), 2), 3)
    ) * 512
    off = gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 1), 3) * 128 + gl.expand_dims(
        gl.expand_dims(gl.expand_dims(c, 0), 1), 2
    )
    gl.store(out + base.to(gl.int64) + off, last)


@gluon.jit
def pair_bench(cache, idx_ptr, n_tok, nblk, out):
    ring = gl.allocate_shared_memory(gl.bfloat16, [2, 2, 64, 4, 128], PS)
    esig = gl.allocate_shared_memory(gl.int32, [2, 2, 256], PES)
    ready = mbarrier.allocate_mbarrier(batch=2)
    empty = mbarrier.allocate_mbarrier(batch=2)
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.fence_init_release_cluster()
    cluster.barrier(relaxed=True)
    gl.warp_specialize(
        [
            (_pair_consumer, (nblk, ring, esig, ready, empty, out)),
            (_pair_producer, (cache, idx_ptr, n_tok, nblk, ring, ready, empty)),
        ],
        [4],
    )
    cluster.barrier()


@gluon.jit
def _solo_producer(cache, idx_ptr, n_tok, nblk, ring, ready, empty):
    pid = gl.program_id(0)
    for j in range(nblk):
        stage = j % 2
        kv = _gather(cache, idx_ptr + ((pid // 2) * nblk + j).to(gl.int64) * 64, n_tok, S3)
        mbarrier.wait(empty.index(stage), ((j // 2) & 1) ^ 1)
        ring.index(stage).store(kv)
        fence_async_shared()
        gl.barrier()
        mbarrier.arrive(ready.index(stage), count=1)


@gluon.jit
def _solo_consumer(nblk, ring, ready, empty, out):
    for j in range(nblk):
        stage = j % 2
        mbarrier.wait(ready.index(stage), (j // 2) & 1)
        mbarrier.arrive(empty.index(stage), count=1)
    last = ring.index((nblk - 1) % 2).load(SR)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, SR)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, SR)))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, SR)))
    base = (gl.program_id(0) * 64 + gl.expand_dims(gl.expand_dims(r, 1), 2)).to(gl.int64) * 512
    off = gl.expand_dims(gl.expand_dims(t, 0), 2) * 128 + gl.expand_dims(gl.expand_dims(c, 0), 1)
    gl.store(out + base + off, last)


@gluon.jit
def solo_bench(cache, idx_ptr, n_tok, nblk, out):
    ring = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 4, 128], SS)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (_solo_consumer, (nblk, ring, ready, empty, out)),
            (_solo_producer, (cache, idx_ptr, n_tok, nblk, ring, ready, empty)),
        ],
        [4],
    )


def compile_both() -> None:
    sig = {"cache": "*u8", "idx_ptr": "*i32", "n_tok": "i32", "nblk": "i32", "out": "*bf16"}
    for name, fn, ctas in (("pair", pair_bench, 2), ("solo", solo_bench, 1)):
        k = triton.compile(
            GluonASTSource(fn=fn, signature=sig, constexprs={}),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=4, num_ctas=ctas),
        )
        ptx = k.asm["ptx"]
        with open(f"/tmp/cluster_producer_{name}.ptx", "w") as f:
            f.write(ptx)
        pats = ("st.async", "st.shared", "ld.global", "cvt.rn.f16x2.e4m3x2", "setmaxnreg")
        print(name, {p: len(re.findall(re.escape(p), ptx)) for p in pats}, "smem", k.metadata.shared)


def run(nblk: int) -> int:
    import torch

    torch.manual_seed(0)
    n_tok = 64 * 32768  # b=64 requests of 32K tokens
    cache = torch.randint(0, 256, (n_tok, REC.value), dtype=torch.uint8, device="cuda")
    cache[:, :512][(cache[:, :512] & 0x7F) == 0x7F] = 0  # no NaN bytes
    scales = 2.0 ** torch.randint(-4, 4, (n_tok, 4), device="cuda").float()
    cache[:, 512:528] = scales.view(torch.uint8).view(n_tok, 16)
    clusters = 66
    idx = torch.randint(0, n_tok, (clusters, nblk, 64), dtype=torch.int32, device="cuda")
    outs = {}
    times = {}
    for name, fn, grid, ctas in (("solo", solo_bench, 132, 1), ("pair", pair_bench, clusters, 2)):
        out = torch.zeros(132, 64, 512, dtype=torch.bfloat16, device="cuda")
        fn[(grid,)](cache, idx, n_tok, nblk, out, num_warps=4, num_ctas=ctas)
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(20):
            fn[(grid,)](cache, idx, n_tok, nblk, out, num_warps=4, num_ctas=ctas)
        ev[1].record()
        torch.cuda.synchronize()
        times[name] = ev[0].elapsed_time(ev[1]) / 20 * 1e3
        outs[name] = out
    # the last block of each pair, dequantised on the host side of the check
    rec = cache[idx[:, -1].long()]  # [66, 64, 656]
    k8 = rec[..., :512].view(torch.float8_e4m3fn).float().view(clusters, 64, 4, 128)
    sc = rec[..., 512:528].contiguous().view(torch.float32).view(clusters, 64, 4, 1)
    want = (k8 * sc).to(torch.bfloat16).view(clusters, 64, 512).repeat_interleave(2, dim=0)
    ok = {name: torch.equal(o, want) for name, o in outs.items()}
    print(f"nblk {nblk}: solo {times['solo']:.1f} us, pair {times['pair']:.1f} us; tiles right: {ok}")
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        sys.exit(run(int(sys.argv[2]) if len(sys.argv) > 2 else 62))
    compile_both()
