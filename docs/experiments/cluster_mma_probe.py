"""Probe (Triton >= 3.8; offline compile, or ``run`` on an sm_90 GPU): a head pair's ``S = Q Kᵀ``
in a 2-CTA cluster, the layout the 64-head kernel's consumer would take at h_q 128: ``Q [128, 64]``
split over the CTAs by rows (``cga_layout=[[1, 0]]``: CTA c holds heads ``[64c, 64c + 64)``), ``K
[64, 64]`` replicated (each CTA its copy, as the exchange of ``cluster_async_store_probe.py``
leaves the ring), the wgmma accumulator split like Q. Offline (session 9, Triton 3.8.0, sm_90a):
4 wgmma per CTA (k 64 in steps of 16), 16 KB of smem per CTA (its 64 rows of Q and its K), the
stores of S unpredicated with addresses from ``%cluster_ctarank`` (each CTA writes its heads).
``qk_exchanged`` adds the exchange in front of the MMA (K made half by each CTA, stored into both
CTAs, read through a replicated ``_reinterpret`` view): compiles to 4 st.async and 4 wgmma per CTA. Both ran right on the H200 in session 10 (max |S -
torch| 3.8e-6).

    python docs/experiments/cluster_mma_probe.py        # compile, PTX counts
    python docs/experiments/cluster_mma_probe.py run    # on the GPU: S against torch
"""

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import cluster, fence_async_shared, mbarrier, warpgroup_mma

SPLIT = [[1, 0]]
REPL = [[0, 0]]
LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=SPLIT)
LK: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=REPL)
SQ: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=SPLIT)
SK: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=REPL)
S_L: gl.constexpr = gl.NVMMADistributedLayout(
    version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16], cga_layout=SPLIT
)


# the exchange feeding the MMA: K rows split over the CTAs, stored into both CTAs' [2, 64, 64]
SK3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3, cga_layout=[[1, 0, 0]])
LV: gl.constexpr = gl.BlockedLayout([2, 1, 8], [1, 4, 8], [1, 4, 1], [2, 1, 0], cga_layout=[[0, 1, 0]])


@gluon.jit
def qk_exchanged(q_ptr, k_ptr, out):
    """``qk`` with K made half by each CTA (rows ``[32r, 32r + 32)``), exchanged with one
    ``async_store`` into both CTAs' ``[2, 64, 64]`` (CTA d holds [d]) and read by the MMA as a
    replicated ``[64, 64]`` (``_reinterpret``: each CTA's own copy)."""
    rq = gl.arange(0, 128, layout=gl.SliceLayout(1, LQ))
    cq = gl.arange(0, 64, layout=gl.SliceLayout(0, LQ))
    qs = gl.allocate_shared_memory(
        gl.bfloat16, [128, 64], SQ, gl.load(q_ptr + gl.expand_dims(rq, 1) * 64 + gl.expand_dims(cq, 0))
    )
    L2: gl.constexpr = gl.SliceLayout(0, LV)
    rk = gl.arange(0, 64, layout=gl.SliceLayout(1, L2))
    ck = gl.arange(0, 64, layout=gl.SliceLayout(0, L2))
    kk = gl.load(k_ptr + gl.expand_dims(rk, 1) * 64 + gl.expand_dims(ck, 0))
    ks = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], SK3)
    bar = mbarrier.allocate_mbarrier()
    mbarrier.init(bar, count=1)
    mbarrier.fence_init_release_cluster()
    cluster.barrier(relaxed=True)
    mbarrier.expect(bar, ks.nbytes_per_cta)
    hopper.async_store(ks, gl.expand_dims(kk, 0).broadcast_to([2, 64, 64]), bar)
    mbarrier.wait(bar, 0, deps=[ks])
    fence_async_shared()
    kmine = ks._reinterpret(gl.bfloat16, [64, 64], SK)
    s = warpgroup_mma(qs, kmine.permute([1, 0]), gl.zeros([128, 64], gl.float32, S_L), use_acc=False)
    ro = gl.arange(0, 128, layout=gl.SliceLayout(1, S_L))
    co = gl.arange(0, 64, layout=gl.SliceLayout(0, S_L))
    gl.store(out + gl.expand_dims(ro, 1) * 64 + gl.expand_dims(co, 0), s)
    cluster.barrier()


@gluon.jit
def qk(q_ptr, k_ptr, out):
    rq = gl.arange(0, 128, layout=gl.SliceLayout(1, LQ))
    cq = gl.arange(0, 64, layout=gl.SliceLayout(0, LQ))
    q = gl.load(q_ptr + gl.expand_dims(rq, 1) * 64 + gl.expand_dims(cq, 0))
    rk = gl.arange(0, 64, layout=gl.SliceLayout(1, LK))
    ck = gl.arange(0, 64, layout=gl.SliceLayout(0, LK))
    kk = gl.load(k_ptr + gl.expand_dims(rk, 1) * 64 + gl.expand_dims(ck, 0))
    qs = gl.allocate_shared_memory(gl.bfloat16, [128, 64], SQ, q)
    ks = gl.allocate_shared_memory(gl.bfloat16, [64, 64], SK, kk)
    fence_async_shared()
    s = warpgroup_mma(qs, ks.permute([1, 0]), gl.zeros([128, 64], gl.float32, S_L), use_acc=False)
    ro = gl.arange(0, 128, layout=gl.SliceLayout(1, S_L))
    co = gl.arange(0, 64, layout=gl.SliceLayout(0, S_L))
    gl.store(out + gl.expand_dims(ro, 1) * 64 + gl.expand_dims(co, 0), s)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        import torch

        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(128, 64, device="cuda", generator=g).to(torch.bfloat16)
        k = torch.randn(64, 64, device="cuda", generator=g).to(torch.bfloat16)
        want = q.float() @ k.float().t()
        bad = 0
        for fn in (qk, qk_exchanged):
            out = torch.full((128, 64), float("nan"), device="cuda")
            fn[(1,)](q, k, out, num_warps=4, num_ctas=2)
            torch.cuda.synchronize()
            err = float((out - want).abs().max())
            print(f"{fn.__name__}: max |S - torch| = {err:.3g}", "(ok)" if err < 1e-2 else "(WRONG)")
            bad += not err < 1e-2
        sys.exit(1 if bad else 0)
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "out": "*fp32"}
    for fn in (qk, qk_exchanged):
        c = triton.compile(
            GluonASTSource(fn=fn, signature=sig, constexprs={}),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=4, num_ctas=2),
        )
        ptx = c.asm["ptx"]
        pats = ("wgmma.mma_async", "st.async", "st.global", "cluster_ctarank")
        print(fn.__name__, {p: len(re.findall(re.escape(p), ptx)) for p in pats}, "smem", c.metadata.shared)
