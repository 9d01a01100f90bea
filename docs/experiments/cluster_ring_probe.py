"""Probe (Triton >= 3.8; offline compile, or ``run`` on an sm_90 GPU): the ring the 64-head decode
kernel would need at h_q 128 with a 2-CTA cluster, without warp specialisation. Each CTA of the
pair makes half of every ``[64, 64]`` bf16 tile (rows ``[32c, 32c + 32)``) and stores it into the
stage of both CTAs with one ``hopper.async_store`` (the ``[2, ...]`` row-per-CTA destination of
``cluster_async_store_probe.py``), completing on each CTA's ``ready[stage]`` (``expect``: the whole
tile, half from itself, half from the peer). Each CTA's consumer reads its copy, sums it, and
releases the stage to both producers by an ``async_store`` of one int32 per thread into each CTA's
``[2, 256]`` signal row, completing on each CTA's ``empty[stage]`` (``expect``: 1 KB, 512 B from each
consumer; a token with replicated elements hung the first run: every replica completes its bytes)
— the cross-CTA "empty" that Triton 3.8's ``mbarrier.arrive`` cannot address. Barriers are made
visible to the peer before use (``fence_init_release_cluster`` + a relaxed cluster barrier) and a
final cluster barrier keeps a CTA alive while the peer may still store into it.

Session 10 on the H200: every CTA summed every whole tile (the first run, with a ``[2, 2]`` token,
hung).

    python docs/experiments/cluster_ring_probe.py          # compile for sm_90a, PTX counts
    python docs/experiments/cluster_ring_probe.py run      # on the GPU: ITERS tiles per CTA checked
"""

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import cluster, mbarrier

ITERS = 6
# the tile each CTA makes: [2 (destination CTA), 64 rows, 64 cols], rows split over the CTAs
L_V: gl.constexpr = gl.BlockedLayout([2, 1, 8], [1, 4, 8], [1, 4, 1], [2, 1, 0], cga_layout=[[0, 1, 0]])
# a stage: [2, 64, 64], CTA d holds [d] (its own whole copy)
S_T: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0], cga_layout=[[1, 0, 0]])
L_T: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, 4, 1], [2, 1, 0], cga_layout=[[1, 0, 0]])
# the release signal: [2 (destination CTA), 256] int32, columns [128c, 128c + 128) from CTA c: one
# element per consumer thread and destination, because async_store stores every replica of a
# replicated element (Triton 3.8: each duplicate completes its bytes on the barrier again)
L_E: gl.constexpr = gl.BlockedLayout([2, 1], [1, 32], [1, 4], [1, 0], cga_layout=[[0, 1]])
S_E: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0], cga_layout=[[1, 0]])


@gluon.jit
def _tile(i: gl.constexpr):
    d = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_V)))
    r = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_V)))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_V)))
    d3 = gl.expand_dims(gl.expand_dims(d, 1), 2)
    r3 = gl.expand_dims(gl.expand_dims(r, 0), 2)
    c3 = gl.expand_dims(gl.expand_dims(c, 0), 1)
    return ((d3 * 0 + r3 * 64 + c3 + i) % 200).to(gl.bfloat16)  # small integers: exact in bf16


@gluon.jit
def ring(out, ITERS: gl.constexpr):
    stages = gl.allocate_shared_memory(gl.bfloat16, [2, 2, 64, 64], S_T)  # [stage, holder CTA, ...]
    signals = gl.allocate_shared_memory(gl.int32, [2, 2, 256], S_E)
    ready = mbarrier.allocate_mbarrier(batch=2)
    empty = mbarrier.allocate_mbarrier(batch=2)
    for s in gl.static_range(2):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.fence_init_release_cluster()
    cluster.barrier(relaxed=True)
    token = gl.full([2, 256], 1, gl.int32, L_E)
    d_out = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_T)))
    for i in gl.static_range(ITERS):
        stage = stages.index(i % 2)
        # producer: wait until both consumers released this stage (iteration i - 2), then store
        # this CTA's half of tile i into both CTAs' stage
        if i >= 2:
            mbarrier.expect(empty.index(i % 2), signals.index(i % 2).nbytes_per_cta)
            mbarrier.wait(empty.index(i % 2), ((i - 2) // 2) & 1)
        mbarrier.expect(ready.index(i % 2), stage.nbytes_per_cta)
        hopper.async_store(stage, _tile(i), ready.index(i % 2))
        mbarrier.wait(ready.index(i % 2), (i // 2) & 1, deps=[stage])
        t = stage.load(L_T)
        # consumer: the whole tile's sum in this CTA's copy (element d of [2]: CTA d's)
        tot = gl.sum(gl.sum(t.to(gl.float32), axis=2), axis=1)
        gl.store(out + (gl.program_id(0) * 2 + d_out) * ITERS + i, tot)
        # release the stage to both producers (not after the last two uses: nobody waits)
        if i + 2 < ITERS:
            hopper.async_store(signals.index(i % 2), token, empty.index(i % 2))
    cluster.barrier()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        import torch

        clusters = 4
        out = torch.full((clusters, 2, ITERS), -1.0, device="cuda")
        ring[(clusters,)](out, ITERS=ITERS, num_warps=4, num_ctas=2)
        torch.cuda.synchronize()
        r = torch.arange(64).view(64, 1) * 64 + torch.arange(64).view(1, 64)
        want = torch.tensor([float(((r + i) % 200).sum()) for i in range(ITERS)]).expand(clusters, 2, ITERS)
        ok = torch.equal(out.cpu(), want)
        print("ring:", "every CTA summed every whole tile" if ok else f"WRONG\n{out}\nwant {want[0, 0]}")
        sys.exit(0 if ok else 1)
    src = GluonASTSource(fn=ring, signature={"out": "*fp32", "ITERS": "constexpr"}, constexprs={(1,): ITERS})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_ctas=2))
    ptx = k.asm["ptx"]
    with open("/tmp/cluster_ring.ptx", "w") as f:
        f.write(ptx)
    pats = ("st.async", "mapa", "mbarrier.try_wait", "expect_tx", "barrier.cluster", "fence.mbarrier_init")
    print({p: len(re.findall(re.escape(p), ptx)) for p in pats}, "smem", k.metadata.shared)
