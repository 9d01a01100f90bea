"""The gather-ceiling benchmark's kernel (``benchmarks/gather.py``) against its PyTorch twin, in
Triton's interpreter on CPU (and compiled on a GPU): random slots, ``-1`` entries, a partial last
group, both V32 records and a strided pool view."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import sparse_mla as flash_mla
from benchmarks.gather import gather_max, gather_max_reference
from sparse_mla.core.target import device_target
from sparse_mla.formats import cache_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n", [64, 150])
def test_gather_max_matches_twin(n):
    g = torch.Generator().manual_seed(n)
    k = torch.randn(6, 16, 1, 576, generator=g).to(torch.bfloat16)
    kc = flash_mla.quantize_k_cache(k, "V32").to(DEVICE)
    idx = torch.randint(-1, 6 * 16 + 8, (n,), generator=g, dtype=torch.int32)  # past the cache: skipped
    idx[:70] = -1 if n == 150 else idx[:70]  # group 0 of the longer list: no valid entry
    idx = idx.to(DEVICE)
    got = gather_max(kc, idx)
    want = gather_max_reference(kc, idx)
    assert got.shape == want.shape == (-(-n // 64),)
    assert torch.equal(got.cpu(), want.cpu())
    if n == 150:
        assert int(got[0]) == -(2**31)


def test_gather_max_pool_view_and_bad_records():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(8, 16, 1, 576, generator=g).to(torch.bfloat16)
    pool = flash_mla.quantize_k_cache(k, "V32").to(DEVICE)
    view = pool[2:6]  # an offset view: slots count from its first block
    idx = torch.randint(0, 4 * 16, (64,), generator=g, dtype=torch.int32).to(DEVICE)
    assert torch.equal(gather_max(view, idx).cpu(), gather_max_reference(view, idx).cpu())
    k1 = torch.randn(2, 16, 1, 512, generator=g).to(torch.bfloat16)
    m1 = flash_mla.quantize_k_cache(k1, "MODEL1").to(DEVICE)  # 584-byte records
    with pytest.raises(ValueError, match="k_cache: records of 584 bytes"):
        gather_max(m1, idx[:4].remainder(32))
    # a broadcast record (byte stride 0) would read past the storage: refused
    flat = torch.zeros(2, 16, 1, 16, dtype=torch.uint8, device=DEVICE)[..., :1].expand(2, 16, 1, 656)
    with pytest.raises(ValueError, match="k_cache: expected .* unit byte stride"):
        gather_max(flat, idx[:4].remainder(32))
    with pytest.raises(ValueError, match=r"out: expected a contiguous int32 \[1\]"):
        gather_max(view, idx, out=torch.empty(0, dtype=torch.int32, device=DEVICE))
    # strided and expanded index views are valid inputs
    for ix in (idx[::2], idx[:1].expand(64)):
        assert torch.equal(gather_max(view, ix).cpu(), gather_max_reference(view, ix).cpu())


_COMPILE_TMA = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from benchmarks.gather import _gather_max_tma_kernel

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

def desc(rows):  # the signature type of a host descriptor, as the launcher would mangle it
    raw = torch.zeros(2, 64 * 41, 16, dtype=torch.uint8)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
    return mangle_type(TensorDescriptor(raw, list(raw.shape), list(raw.stride()), [1, rows, 16], layout))

sig = dict(nope_desc=desc(32), tail_desc=desc(16), idx_ptr="*i32", n="i32", n_slots="i32", out_ptr="*i32",
           PBS="constexpr", NS="constexpr")
names = list(sig)
src = GluonASTSource(fn=_gather_max_tma_kernel, signature=sig,
                     constexprs={(names.index("PBS"),): 64, (names.index("NS"),): 4},
                     attrs={(names.index("idx_ptr"),): [["tt.divisibility", 16]],
                            (names.index("out_ptr"),): [["tt.divisibility", 16]]})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ptx = k.asm["ptx"]
gaps = ptx.split("cp.async.bulk.tensor.3d")[1:-1]  # the code between consecutive copies
print(json.dumps(dict(copies=ptx.count("cp.async.bulk.tensor.3d"), shared=k.metadata.shared,
                      gaps_with_barrier=sum("bar.sync" in t or "barrier.sync" in t for t in gaps))))
"""


def test_tma_gather_kernel_compiles_for_hopper():
    # the tensor-memory gather (benchmarks/gather.py --tma) compiled for sm_90a with no GPU (in a
    # process without the interpreter): two copies a record, each loader warp's 32 issued with no
    # CTA barrier between them (barriers only where one loader's code ends and the next one's
    # begins), a ring of four 48 KB stages within the 227 KB of shared memory
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), root, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _COMPILE_TMA], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["copies"] == 128 and got["gaps_with_barrier"] <= 3, got
    assert 4 * 48 * 1024 <= got["shared"] <= 227 * 1024, got


def _tma_gather_fits() -> bool:
    """sm_90+ with the 196 KB of shared memory four stages take (not consumer Blackwell's 100 KB)."""
    if DEVICE != "cuda" or not device_target(torch.device(DEVICE)).tma:
        return False
    return torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= 200 * 1024


@pytest.mark.skipif(not _tma_gather_fits(), reason="tensor-memory copies, 196 KB of shared memory: sm_90 / sm_100")
def test_gather_max_tma_matches_twin():
    # two programs over 40 groups (the ring wraps many times at 2 and 4 stages), on small bytes with
    # planted maxima: in the last word of a record's second box (must count), in the 112 bytes of
    # the next record that box also copies (must not), in slot 0 for a group of invalid indices
    # (must not: they copy slot 0); and the last tokens of the blocks (the box runs past the block)
    from benchmarks.gather import gather_max_tma

    g = torch.Generator().manual_seed(5)
    k = torch.randn(10, 64, 1, 576, generator=g).to(torch.bfloat16)
    pool = flash_mla.quantize_k_cache(k, "V32").to(DEVICE)
    raw = cache_bytes(pool)
    raw.copy_(torch.randint(0, 16, raw.shape, generator=g, dtype=torch.uint8).to(DEVICE))
    for cache in (pool, pool[3:9]):  # a pool view: its block stride and offset
        n_slots = cache.shape[0] * cache.shape[1]
        r = cache_bytes(cache)[:, :, 0].reshape(n_slots, 656)
        a, b_ = 130, 200  # record a: the tail's last word; record b_ + 1: bytes the tail box of b_ reads
        r[a, 652:656] = torch.tensor([1, 1, 1, 0x70], dtype=torch.uint8)
        r[b_ + 1, :112] = 0x7F
        r[0, :512] = 0x7E
        idx = torch.randint(1, n_slots, (64 * 40,), generator=g, dtype=torch.int32)
        idx[idx == b_ + 1] = 2
        idx[64 * 3 + 5] = a
        idx[64 * 7 + 9] = b_
        idx[64 * 11 : 64 * 11 + 32] = -1
        idx[64 * 11 + 32 : 64 * 12] = n_slots + 3  # past the cache
        idx[64 * 20 : 64 * 21] = torch.arange(n_slots - 64, n_slots, dtype=torch.int32)  # the last tokens
        idx = torch.cat([idx, idx[:11]]).to(DEVICE)  # a partial last group
        want = gather_max_reference(cache, idx).cpu()
        assert int(want[3]) == 0x70010101 and int(want[11]) == -(2**31) and int(want[7]) < 0x10000000
        for stages in (2, 4):
            got = gather_max_tma(cache, idx, stages=stages, programs=2).cpu()
            assert torch.equal(got, want), (stages, (got != want).nonzero().flatten().tolist())
        r[a, 652:656] = 0
        r[b_ + 1, :112] = 0
        r[0, :512] = 0
