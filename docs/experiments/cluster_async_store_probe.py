"""Offline probe (Triton >= 3.8, no GPU needed): how Gluon's ``hopper.async_store`` (st.async into
a CTA cluster's shared memory) picks the CTA it writes, for a 2-CTA cluster, by the CGA layouts of
the value (registers) and of the destination (shared memory). Session 9's reading of the PTX, with
Triton 3.8.0 for sm_90a:

* CGA bases count CTA tiles, not elements: ``cga_layout=[[1]]`` puts the second CTA on the second
  tile of a dim (``[[128]]`` for a 256-element tensor fails the layout's surjectivity check);
* value split over the CTAs, destination split the same way (``split_to_split``) or both
  replicated (``repl_to_repl``): ``mapa`` with ``%cluster_ctarank``: each CTA writes its own copy;
* value split, destination replicated (``split_to_repl``): ``mapa`` with rank 0 for every CTA: both
  halves land in CTA 0's copy and CTA 1's stays empty (the first owner of an element is written);
* with ``num_ctas=2``, ``gl.program_id(0)`` reads ``%clusterid.x``: the grid counts clusters.

* **what the pair needs** (``pair``): a destination ``[2, N]`` whose dim 0 is the CTA that holds
  it (smem ``cga_layout=[[1, 0]]``: CTA d holds row d, its whole copy) and a value ``[2, N]`` whose
  dim 1 is split over the CTAs (registers ``cga_layout=[[0, 1]]``: CTA c computed half c of the N
  elements, for both rows d): every CTA issues two ``st.async`` of the same registers, ``mapa`` to
  rank 0 and to rank 1, each completing on the destination CTA's mbarrier, and each CTA's
  ``expect`` is its whole row (half from itself, half from the peer). That is FlashMLA's h_q 128
  exchange (each CTA converts half of the tile, both rings get all of it) in Gluon 3.8; the value
  costs no extra registers (the row index does not change the data). Run on the H200 (session 9,
  Triton 3.8.0 carried, ``pair-run``): both CTAs held the whole row.

* a global store of a replicated tensor is predicated on ``%cluster_ctarank == 0`` (the second
  CTA's copy is redundant to the compiler, like a redundant thread's): under ``num_ctas=2`` every
  tensor whose values differ between the CTAs (the pair's two head blocks: Q, S, P, O, lse) has to
  be split over the CTAs in its layout (heads ``[128, ...]`` with ``cga_layout=[[1, 0]]``), and the
  K ring replicated for the MMAs (``[64, 576]``, each CTA its copy) while the exchange stores into
  a ``[2, 64, 576]`` row-per-CTA view of the same bytes (a reinterpreted descriptor; not tried).

Not settled offline: the ring's ``empty`` side (a CTA may write into the peer's stage only after
the peer's consumers released it; 3.8's ``mbarrier.arrive`` has no peer target, 3.9 adds
``from_cta``; a 4-byte ``st.async`` onto the peer's barrier would do), and what layouts without
``cga_layout`` mean under ``num_ctas=2`` (the kernel's other tensors). Run:

    python docs/experiments/cluster_async_store_probe.py pair       # PTX counts, writes /tmp/pair.ptx
    python docs/experiments/cluster_async_store_probe.py pair-run   # on an sm_90 GPU: runs and checks
"""

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

VARIANT = sys.argv[1]
N = 256
L_SPLIT: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0], cga_layout=[[1]])
L_REPL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0], cga_layout=[[0]])
S_SPLIT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0], cga_layout=[[1]])
S_REPL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0], cga_layout=[[0]])


# the pair exchange: value [2 (destination CTA), 256] split on dim 1, smem [2, 256] split on dim 0
L_V: gl.constexpr = gl.BlockedLayout([2, 1], [1, 32], [1, 4], [1, 0], cga_layout=[[0, 1]])
S_M: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0], cga_layout=[[1, 0]])
L_M: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, 4], [1, 0], cga_layout=[[1, 0]])


@gluon.jit
def pair(out):
    d = gl.arange(0, 2, layout=gl.SliceLayout(1, L_V))
    e = gl.arange(0, 256, layout=gl.SliceLayout(0, L_V))
    v = (gl.expand_dims(d, 1) * 0 + gl.expand_dims(e, 0)).to(gl.int32)
    smem = gl.allocate_shared_memory(gl.int32, [2, 256], S_M)
    bar = mbarrier.allocate_mbarrier()
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, smem.nbytes_per_cta)
    hopper.async_store(smem, v, bar)
    mbarrier.wait(bar, 0, deps=[smem])
    r = smem.load(L_M)
    rd = gl.arange(0, 2, layout=gl.SliceLayout(1, L_M))
    re_ = gl.arange(0, 256, layout=gl.SliceLayout(0, L_M))
    gl.store(out + gl.expand_dims(rd, 1) * 256 + gl.expand_dims(re_, 0), r)


@gluon.jit
def probe(out, VARIANT: gl.constexpr):
    if VARIANT == "split_to_repl":
        offs = gl.arange(0, 256, layout=L_SPLIT)
        smem = gl.allocate_shared_memory(gl.int32, [256], S_REPL)
    elif VARIANT == "repl_to_repl":
        offs = gl.arange(0, 256, layout=L_REPL)
        smem = gl.allocate_shared_memory(gl.int32, [256], S_REPL)
    else:  # split_to_split
        offs = gl.arange(0, 256, layout=L_SPLIT)
        smem = gl.allocate_shared_memory(gl.int32, [256], S_SPLIT)
    v = offs.to(gl.int32) + 1000 * gl.program_id(0)
    bar = mbarrier.allocate_mbarrier()
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, smem.nbytes_per_cta)
    hopper.async_store(smem, v, bar)
    mbarrier.wait(bar, 0, deps=[smem])
    r = smem.load(L_REPL)
    o = gl.arange(0, 256, layout=L_REPL)
    gl.store(out + gl.program_id(0) * 256 + o, r)


if VARIANT == "pair-run":  # on a Hopper GPU: launch one cluster of 2 CTAs and check both copies
    import torch

    out = torch.full((2, 256), -1, dtype=torch.int32, device="cuda")
    pair[(1,)](out, num_warps=4, num_ctas=2)
    torch.cuda.synchronize()
    want = torch.arange(256, dtype=torch.int32, device="cuda").expand(2, 256)
    print("pair-run:", "both CTAs hold the whole row" if torch.equal(out, want) else f"WRONG\n{out}")
    sys.exit(0 if torch.equal(out, want) else 1)
if VARIANT == "pair":
    src = GluonASTSource(fn=pair, signature={"out": "*i32"}, constexprs={})
else:
    src = GluonASTSource(fn=probe, signature={"out": "*i32", "VARIANT": "constexpr"}, constexprs={(1,): VARIANT})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_ctas=2))
ptx = k.asm["ptx"]
open(f"/tmp/{VARIANT}.ptx", "w").write(ptx)
open(f"/tmp/{VARIANT}.ttgir", "w").write(k.asm["ttgir"])
print(
    VARIANT,
    {
        pat: len(re.findall(re.escape(pat), ptx))
        for pat in ("st.async", "mapa", "mbarrier", "cluster_ctarank", "st.shared", "barrier.cluster")
    },
)
