"""Offline compile check of the indexer's ``tl`` kernels (no GPU needed).

    PYTHONPATH=src python3 scripts/indexer_compile_check.py [--arch 90] [--dump DIR]

Compiles the paged and prefill logits kernels (DeepSeek-V3.2 shapes: H 64, D 128, next_n 1, 2, 4)
and the top-k select kernel with their default launch parameters for ``GPUTarget("cuda", arch, 32)``,
assembles the PTX with the ptxas shipped with Triton and prints, per kernel: registers, spills,
shared memory, and the MMA / async-copy instructions in the PTX (wgmma with e4m3 operands on sm_90,
mma on sm_80/89, cp.async for the pipelined loads). Exit code 1 if a kernel fails to compile, spills
more than ``--max-spill`` bytes, or (sm_89+) the logits kernels have no FP8 MMA.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse_mla.indexer.kernels import logits as L
from sparse_mla.indexer.kernels import topk as T
from sparse_mla.indexer.kernels import topk_bisect as TB
from sparse_mla.indexer.kernels import topk_radix as TR

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = {
    "q_ptr": "*u8",
    "kv_ptr": "*u8",
    "cache_ptr": "*u8",
    "scale_ptr": "*fp32",
    "w_ptr": "*fp32",
    "ks_ptr": "*i32",
    "ke_ptr": "*i32",
    "ctx_ptr": "*i32",
    "bt_ptr": "*i32",
    "out_ptr": "*fp32",
    "x_ptr": "*fp32",
    "lo_ptr": "*i64",
    "hi_ptr": "*i64",
    "dst_ptr": "*i64",
    "scr_ptr": "*i64",
    "cand_ptr": "*i64",
    "hist_ptr": "*i32",
    "t_ptr": "*i32",
    "rk_ptr": "*i64",
    "cnt_ptr": "*i32",
    "flag_ptr": "*i32",
    "k_desc": "tensordesc<fp8e4nv[1,64,128]>",
    "s_desc": "tensordesc<fp32[1,64]>",
}
UNIT = {"stride_wh", "stride_qh"}  # may be 1 at run time; keep them plain i32
#: tuple parameters: their elements' names (typed and specialised as the names say)
TUPLES = {
    "query": ("q_ptr", "stride_qb", "stride_qn", "stride_qh"),
    "table": ("bt_ptr", "stride_bt", "n_log", "pbs", "next_n"),
}


def _div16(name: str) -> bool:
    return (name in PTRS and not name.endswith("_desc")) or (
        (name.startswith("stride") or name in ("bs",)) and name not in UNIT
    )


def compile_one(kern, consts: dict, num_warps: int, arch: int, ptrs: dict | None = None, maxnreg: int | None = None):
    names = list(inspect.signature(kern.fn).parameters)
    types = {**PTRS, **(ptrs or {})}
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in TUPLES:
            sig[n] = tuple(types.get(e, "i32") for e in TUPLES[n])
            attrs.update({(i, j): [["tt.divisibility", 16]] for j, e in enumerate(TUPLES[n]) if _div16(e)})
        else:
            sig[n] = types.get(n, "constexpr" if n in consts else "i32")
            if _div16(n):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {})),
    )


def cases(arch: int):
    fp8 = arch >= 89
    dot = dict(FP8_DOT=fp8, DOT_DTYPE=tl.float16, DOT_PREC=None, FOR_LOOP=True)
    pc = L.PAGED_CONFIG
    for next_n in (1, 2, 4):
        p, h_p2 = L._rows_tile(64, next_n, pc.rows)
        warps = L.paged_warps(pc, p * h_p2, fp8)
        consts = dict(D=128, P=p, H_P2=h_p2, BLOCK_N=pc.block_n, NUM_STAGES=pc.num_stages, **dot)
        yield f"paged next_n={next_n} H=64 D=128", L._paged_mqa_logits_kernel, consts, warps
        if arch >= 90:
            tma = dict(consts, NUM_STAGES=pc.tma_stages, HEAD_PAD=False, FOR_LOOP=True)
            for key in ("FP8_DOT", "DOT_DTYPE", "DOT_PREC"):
                tma.pop(key)
            yield f"paged tensor-memory next_n={next_n} H=64 D=128", L._paged_tma_logits_kernel, tma, warps
    fc = L.PREFILL_CONFIG
    bq, h_p2 = L._rows_tile(64, 4096, fc.rows)
    consts = dict(D=128, BQ=bq, H_P2=h_p2, BLOCK_N=fc.block_n, NUM_STAGES=fc.num_stages, **dot)
    yield "prefill H=64 D=128", L._mqa_logits_kernel, consts, fc.num_warps
    tc = T.TOPK_CONFIG
    topk = dict(BLOCK=tc.block, K_P2=2048, SLOTS=False, FOR_LOOP=True, S_P2=8, HB=T.HIST_BITS, SORTED=True)
    seg = dict(S_P2=8, BLOCK=tc.block, FOR_LOOP=True, HB=T.HIST_BITS)
    for level in (0, 1):
        yield f"topk histogram level {level}", TR._topk_hist_kernel, {**seg, "LEVEL": level}, tc.num_warps
    yield "topk split", TR._topk_split_kernel, seg, tc.num_warps
    yield "topk k=2048 (candidate list)", TR._topk_kernel, topk, tc.final_warps or tc.num_warps
    yield "topk slots k=2048", TR._topk_kernel, {**topk, "SLOTS": True}, tc.final_warps or tc.num_warps
    yield "topk k=2048 unsorted", TR._topk_kernel, {**topk, "SORTED": False}, tc.final_warps or tc.num_warps
    cap = min(tc.bisect, 2048 * tc.bisect_cap)
    bis = dict(
        N_P2=tc.bisect,
        BLOCK=tc.block,
        K_P2=2048,
        CAP=cap,
        THREADS=32 * tc.bisect_warps,
        TIE_BITS=15,
        SLOTS=False,
        SORTED=False,
        FOR_LOOP=True,
        PACK16=True,
        ASM=True,
        INSIDE=tc.bisect // (32 * tc.bisect_warps),  # (a row of exactly `bisect` entries: no load masks)
    )
    yield "topk k=2048 bisect, unsorted", TB._topk_bisect_kernel, bis, tc.bisect_warps
    yield (
        "topk k=2048 bisect, unsorted, 32-bit top bits",
        TB._topk_bisect_kernel,
        {**bis, "PACK16": False},
        tc.bisect_warps,
    )
    yield "topk k=2048 bisect, sorted", TB._topk_bisect_kernel, {**bis, "SORTED": True}, tc.bisect_warps
    # the split path (256 x 32768, k 2048, the launcher's sizes)
    cap = min(tc.bisect, max(2048 * tc.split_cap, 32 * tc.split_list_warps))
    sample = min(tc.split_sample, cap)
    thr = dict(CAP=cap, SAMPLE_G=min(64, sample), SAMPLE_L=sample // min(64, sample), END=20, PDL=False)
    yield "topk split path: threshold", TB._topk_threshold_kernel, thr, tc.split_sample_warps
    chunk = dict(CHUNK=tc.split_chunk, THREADS=32 * tc.split_warps, PDL=False)
    yield "topk split path: positions", TB._topk_split_pos_kernel, chunk, tc.split_warps
    lst = dict(
        NCH=tc.bisect // tc.split_chunk, CHUNK=tc.split_chunk, CAP=cap, THREADS=32 * tc.split_list_warps,
        TIE_BITS=15, N_P2=tc.bisect, K_P2=2048, SLOTS=False, SORTED=False, PDL=False, BLOCK=min(tc.block, 1024),
        FOR_LOOP=True,
    )  # fmt: skip
    yield "topk split path: list, unsorted", TB._topk_list_kernel, lst, tc.split_list_warps
    yield "topk split path: list, sorted", TB._topk_list_kernel, {**lst, "SORTED": True}, tc.split_list_warps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90, 89, 80)")
    ap.add_argument("--dump", default=None, help="directory for ttgir/ptx per kernel")
    ap.add_argument("--max-spill", type=int, default=0)
    a = ap.parse_args()
    dump = a.dump or tempfile.mkdtemp(prefix="indexer_cc_")
    os.makedirs(dump, exist_ok=True)
    ptxas_arch = f"sm_{a.arch}a" if a.arch == 90 else f"sm_{a.arch}"
    ok = True
    for name, kern, consts, warps in cases(a.arch):
        tag = re.sub(r"[^a-z0-9]+", "_", name.lower())
        try:
            ptrs = (
                {"out_ptr": "*i32"} if kern in (TR._topk_kernel, TB._topk_bisect_kernel, TB._topk_list_kernel) else None
            )
            tma_cap = kern is L._paged_tma_logits_kernel
            reg = L.PAGED_CONFIG.tma_maxnreg if tma_cap else None
            k = compile_one(kern, consts, warps, a.arch, ptrs, reg)
        except Exception as e:  # noqa: BLE001 (report and go on)
            print(f"{name}: COMPILE FAILED: {type(e).__name__}: {str(e)[:2000]} {e.__cause__!r}")
            ok = False
            continue
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"{tag}.{ext}"), "w") as f:
                f.write(k.asm[ext])
        ptx = k.asm["ptx"]
        counts = {
            pat: len(re.findall(re.escape(pat), ptx))
            for pat in ("wgmma.mma_async", "e4m3", "mma.sync", "cp.async", "ld.global.v4", "bar.sync", "shfl.sync")
        }
        ptx_path = os.path.join(dump, f"{tag}.ptx")
        r = subprocess.run(
            [os.path.join(BIN, "ptxas"), f"-arch={ptxas_arch}", "-v", ptx_path, "-o", ptx_path + ".cubin"],
            capture_output=True,
            text=True,
        )
        regs = re.search(r"Used (\d+) registers", r.stderr)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
        st, ld = (int(spill.group(1)), int(spill.group(2))) if spill else (-1, -1)
        print(
            f"{name}: warps={warps} regs={regs.group(1) if regs else '?'} spill st/ld={st}/{ld} "
            f"smem={k.metadata.shared} B  " + " ".join(f"{p}={c}" for p, c in counts.items())
        )
        if r.returncode != 0:
            print("  ptxas failed:", r.stderr[-2000:])
            ok = False
        # the tensor-memory kernel's register cap (3 programs per SM) costs 12 B of spills at
        # next_n 2: measured faster than 180 registers without them (H200, 2026-12-01)
        limit = a.max_spill + (16 if tma_cap else 0)
        if st > limit or ld > limit:
            ok = False
        if not name.startswith("topk") and a.arch >= 89:
            fp8_mma = counts["wgmma.mma_async"] if a.arch == 90 else counts["mma.sync"]
            if not fp8_mma or not counts["e4m3"]:
                print("  no FP8 MMA in the PTX")
                ok = False
    print(f"ptx/ttgir in {dump}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
