"""The tensor core's rate from shared memory: how long a Hopper ``wgmma`` takes per instruction as
its N (the heads of a narrow tile, the tokens of a 64-head one) shrinks, and whether its operands'
shared-memory reads, not its FLOPs, set that time.

    python -m benchmarks.wgmma_probe [--iters 2048] [--json PATH]

One CTA per SM, ``wg`` warpgroups each running a dependent chain of ``m64nNk16`` bf16 wgmmas (fp32
accumulator) on the same shared-memory tiles, four a 64-deep K tile, two tiles in flight
(``warpgroup_mma_wait(1)``); nothing else in the loop. Modes: ``ss`` (A ``[64, K]`` K-major and B
from shared memory, as the decode's Sᵀ = K Qᵀ and S = Q Kᵀ), ``ss_ta`` (A MN-major, a permuted
``[K, 64]`` tile, as the narrow consumer's Oᵀ = Vᵀ Pᵀ), ``rs`` (A from registers). Each row prints ns
per instruction per warpgroup, the SM's bf16 FLOP rate, and the shared-memory bytes a cycle the
instructions would read if each read A (2 KB) and B (``N x 32`` B) once (``bytes/clk``, at the
clock the run measured from ``clock64``): read against the 128 B/clk an SM's shared memory
delivers, a rate pinned near it says the operand reads bound the wgmma; a rate that keeps growing
as N shrinks says something else (issue) does.
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from sparse_mla.decode.kernels.hopper import _cta_barrier

from . import harness

K_DEPTH = 64  # K values a loop step (four k16 instructions)
K_TILE = gl.constexpr(K_DEPTH)


@gluon.jit
def _wgmma_loop_kernel(out_ptr, clk_ptr, iters, N: gl.constexpr, MODE: gl.constexpr, WG: gl.constexpr):
    """``iters`` x (4 wgmmas ``m64nNk16``) per warpgroup; writes the accumulator's sum (so nothing is
    dead) and, from warp 0 of CTA 0, the ``clock64`` cycles the loop took."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG, 1], instr_shape=[16, N, 16])
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    fill: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4 * WG, 1], [1, 0])
    b_smem = gl.allocate_shared_memory(
        gl.bfloat16, [N, K_TILE], gl.NVMMASharedLayout.get_default_for([N, K_TILE], gl.bfloat16)
    )
    if MODE == 1:  # A MN-major: a [K, M] tile read through its transpose
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [K_TILE, 64 * WG], sw)
        a_smem.store(gl.full([K_TILE, 64 * WG], 0.001, gl.bfloat16, fill))
    else:
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [64 * WG, K_TILE], sw)
        a_smem.store(gl.full([64 * WG, K_TILE], 0.001, gl.bfloat16, fill))
    b_smem.store(gl.full([N, K_TILE], 0.002, gl.bfloat16, fill))
    fence_async_shared()
    _cta_barrier()
    acc = gl.zeros([64 * WG, N], gl.float32, mma_l)
    if MODE == 2:  # rs: A in registers, loaded once
        a_reg = a_smem.load(gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2))
    t0 = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    for _ in range(iters):
        if MODE == 0:
            acc = warpgroup_mma(a_smem, b_smem.permute([1, 0]), acc, is_async=True)
        elif MODE == 1:
            acc = warpgroup_mma(a_smem.permute([1, 0]), b_smem.permute([1, 0]), acc, is_async=True)
        else:
            acc = warpgroup_mma(a_reg, b_smem.permute([1, 0]), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    t1 = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))
    if gl.program_id(0) == 0:
        gl.store(clk_ptr, t1 - t0)


MODES = {"ss": 0, "ss_ta": 1, "rs": 2}


def run(n: int, mode: str, wg: int, iters: int, sms: int) -> dict:
    """One row: ``sms`` CTAs of ``wg`` warpgroups, ``iters`` K tiles each; times by CUDA events."""
    out = torch.empty(sms, dtype=torch.float32, device="cuda")
    clk = torch.zeros(1, dtype=torch.int64, device="cuda")

    def call():
        _wgmma_loop_kernel[(sms,)](out, clk, iters, N=n, MODE=MODES[mode], WG=wg, num_warps=4 * wg)

    us = harness.median_us(call, quick=True)
    instr = iters * (K_DEPTH // 16)  # per warpgroup
    cycles = int(clk.item())
    ghz = cycles / (us * 1e3) if cycles else float("nan")
    flops = 2 * 64 * n * K_DEPTH * iters * wg * sms
    a_b = (0 if mode == "rs" else 64 * 16 * 2) + n * 16 * 2  # bytes read if each instruction reads A and B once
    return dict(
        n=n, mode=mode, wg=wg, iters=iters, us=us, ns_per_instr=us * 1e3 / instr, clk_ghz=ghz,
        cycles_per_instr_sm=cycles / (instr * wg) if cycles else None, tflops=flops / us / 1e6,
        bytes_per_clk_once=a_b * wg * instr / cycles if cycles else None,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2048, help="64-deep K tiles per warpgroup")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("benchmarks.wgmma_probe: needs a Hopper (sm_90) GPU", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(
        f"{'mode':>6} {'wg':>2} {'N':>4} {'ns/instr':>9} {'cyc/instr/SM':>13} {'TFLOP/s':>8} {'B/clk if A,B read once':>23}"
    )
    for mode in ("ss", "ss_ta", "rs"):
        for wg in (1, 2):
            for n in (8, 16, 32, 64, 128, 256):
                r = run(n, mode, wg, a.iters, sms)
                rows.append(r)
                print(f"{mode:>6} {wg:>2} {n:>4} {r['ns_per_instr']:9.2f} {r['cycles_per_instr_sm']:13.1f} "
                      f"{r['tflops']:8.1f} {r['bytes_per_clk_once']:23.1f}", flush=True)  # fmt: skip
    print(f"results: {harness.write_results('wgmma_probe', dict(iters=a.iters, rows=rows), a.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
