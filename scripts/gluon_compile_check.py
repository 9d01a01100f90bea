"""Offline Hopper compile check of the Gluon sparse decode kernel (no GPU needed).

    PYTHONPATH=src python3 scripts/gluon_compile_check.py [--sink] [--topk-len] [--pbs 61] [--model1]
        [--heads 16|32|64] [--extra | --bf16-kv [--align 16|8|4|2]] [--max-logits] [--dump DIR]

Runs on any machine with Triton (no GPU needed): check the Hopper kernel compiles, and what it costs
in registers, spills and shared memory, after every change to it.

Compiles ``sparse_mla.decode.kernels.hopper._sparse_decode_gluon_kernel`` for sm_90a
(``GPUTarget("cuda", 90, 32)``), prints Triton's register/smem numbers, assembles the PTX with the
ptxas shipped with Triton (``-arch=sm_90a -v``: registers, spills per kernel) and counts HGMMA /
mbarrier / setmaxnreg instructions in the SASS (``cuobjdump -sass``). Exit code 1 if something
expected is missing (HGMMA, spills over the threshold, smem over 227 KiB).

``--max-logits`` compiles the ``HAS_MAX_LOGITS`` epilogue (the sparse prefill's route on the FP8
cache). ``--bf16-kv`` compiles the sparse prefill's variant on bf16 ``kv`` rows (``KV_BF16``, with
that epilogue; ``--model1`` for d_qk 512): its producer copies with ``cp.async`` (the PTX
``cp.async`` and SASS ``LDGSTS.E`` counts; SASS ``LDG`` counts plain loads only); ``--align`` below
16 compiles it for rows that are not 16-byte aligned (views; 2: the register fallback).
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
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from sparse_mla.decode.kernels import hopper as sdg

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# the kernel's tuple arguments, element by element (names as in the launcher's packing)
TUPLES = {
    "q": ("q_ptr", "stride_qb", "stride_qs", "stride_qh"),
    "cache": ("kv_ptr", "stride_blk", "stride_tok", "num_tokens", "pbs"),
    "sel": ("idx_ptr", "stride_ib", "stride_is", "stride_it", "topk", "topk_len_ptr"),
    "xcache": ("xkv_ptr", "x_stride_blk", "x_num_tokens", "x_pbs"),
    "xsel": ("xidx_ptr", "x_stride_ib", "x_stride_is", "x_stride_it", "x_topk", "x_len_ptr"),
    "sched": ("meta_ptr", "nsplit_ptr", "mainblk_ptr", "nblk_ptr"),
    "out": ("out_ptr", "stride_ob", "stride_os", "stride_oh"),
    "lse": ("lse_ptr", "stride_lb", "stride_lh", "stride_ls"),
    "o_acc": ("oacc_ptr", "stride_ar", "stride_as", "stride_ah"),
    "lse_acc": ("lacc_ptr", "stride_lr", "stride_lsq"),
    "max_logits": ("ml_ptr", "stride_mlb", "stride_mlh"),
}
PTRS = {
    "q_ptr": "*bf16",
    "kv_ptr": "*u8",
    "idx_ptr": "*i32",
    "topk_len_ptr": "*i32",
    "xkv_ptr": "*u8",
    "xidx_ptr": "*i32",
    "x_len_ptr": "*i32",
    "sink_ptr": "*fp32",
    "meta_ptr": "*i32",
    "nsplit_ptr": "*i32",
    "mainblk_ptr": "*i32",
    "nblk_ptr": "*i32",
    "out_ptr": "*bf16",
    "lse_ptr": "*fp32",
    "oacc_ptr": "*fp32",
    "lacc_ptr": "*fp32",
    "ml_ptr": "*fp32",
}
# strides that are 1 at run time (Triton specialises them as constants; keep them plain i32 here)
UNIT = {"stride_it", "x_stride_it", "stride_ls", "stride_lsq"}
SMEM_LIMIT = 232448  # 227 KiB opt-in on H100/H200


def default_producer_warps(heads: int) -> int:
    c = sdg.HopperConfig()
    return c.producer_warps if heads == 64 else c.narrow16_producer_warps if heads == 16 else c.narrow_producer_warps


def _register_defaults(a: argparse.Namespace) -> None:
    """``--producer-regs`` / ``--maxnreg`` left out: the HopperConfig values for the head tile."""
    c = sdg.HopperConfig()
    if a.producer_regs is None:
        a.producer_regs = c.narrow16_producer_regs if a.heads == 16 else c.producer_regs
    if a.maxnreg is None:
        a.maxnreg = c.narrow16_maxnreg if a.heads == 16 else c.maxnreg


def compile_kernel(
    has_sink: bool,
    has_topk_len: bool,
    pbs_pow2: bool,
    pbs_log2: int,
    producer_regs: int,
    maxnreg: int,
    model1: bool = False,
    extra: bool = False,
    heads: int = 64,
    bf16_kv: bool = False,
    align: int = 16,
    max_logits: bool = False,
    pv_regs: int = sdg.HopperConfig().pv_regs,
    producer_warps: int | None = None,
    half_stages: bool = False,
    narrow_rowsum: bool | None = None,
    narrow_staged_out: bool | None = None,
):
    kern = sdg._sparse_decode_gluon_kernel
    names = list(inspect.signature(kern.fn).parameters)
    consts = dict(
        KV_BF16=bf16_kv,
        IS_V32=not model1,
        HAS_TOPK_LEN=has_topk_len,
        HAS_EXTRA=extra,
        HAS_EXTRA_LEN=extra and has_topk_len,
        HAS_SINK=has_sink,
        HAS_MAX_LOGITS=max_logits or bf16_kv,
        PBS_POW2=pbs_pow2,
        PBS_LOG2=pbs_log2,
        ALIGN=align,
        PRODUCER_WARPS=default_producer_warps(heads) if producer_warps is None else producer_warps,
        PRODUCER_REGS=producer_regs,
        HEADS=heads,
        PV_REGS=pv_regs,
        HALF_STAGES=half_stages,
        NARROW_ROWSUM=sdg.resolve_narrow_rowsum(narrow_rowsum, heads, not model1),
        NARROW_STAGED=sdg.resolve_narrow_staged_out(narrow_staged_out, heads, bf16_kv, max_logits or bf16_kv),
    )
    ptrs = dict(PTRS, kv_ptr="*bf16") if bf16_kv else PTRS
    div16 = {n for n in ptrs} | {n for t in TUPLES.values() for n in t if n.startswith("stride") and n not in UNIT}
    if align < 16:  # bf16 rows whose addresses are not 16-byte aligned (a 2-byte aligned base pointer at 2)
        div16 -= {"kv_ptr", "stride_blk"} if align < 4 else {"stride_blk"}

    def ty(n: str) -> str:
        return ptrs[n] if n in ptrs else "fp32" if n == "scale_log2" else "i32"

    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in TUPLES:
            sig[n] = tuple(ty(e) for e in TUPLES[n])
            attrs.update({(i, j): [["tt.divisibility", 16]] for j, e in enumerate(TUPLES[n]) if e in div16})
        else:
            sig[n] = ty(n)
            if n in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(
        fn=kern, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs
    )
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=sdg.CONSUMER_WARPS, maxnreg=maxnreg)
    )


def _sass_re(pat: str) -> str:
    """A SASS opcode pattern; ``LDG`` is the plain global loads (not ``LDGSTS``/``LDGDEPBAR``)."""
    return r"\bLDG\." if pat == "LDG" else r"\b" + re.escape(pat)


def sass_regions(sass: str):
    """Split the SASS at USETMAXREG instructions; count spills and key instructions per region."""
    out, cur, c = [], "entry", {}
    pats = ("STL", "LDL", "HGMMA", "LDG", "LDGSTS.E", "STS", "SYNCS.ARRIVE", "SYNCS.PHASECHK", "BAR.SYNC")
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.(\S+)\s+(?:\S+,\s*)?(0x[0-9a-f]+)", line)
        if m:
            out.append((cur, c))
            cur, c = f"{m.group(1)} {int(m.group(2), 16)} regs", {}
        for pat in pats:
            if re.search(_sass_re(pat), line):
                c[pat] = c.get(pat, 0) + 1
    out.append((cur, c))
    return [(k, v) for k, v in out if v]


def inner_loop_counts(sass: str) -> dict:
    """Instruction counts between the consumer's first ready-barrier wait and its empty arrive."""
    lines = sass.splitlines()
    start = next((i for i, line in enumerate(lines) if re.search(r"HGMMA\.64x(32|64)x16", line)), None)
    if start is None:
        return {}
    b = next(i for i in range(start, -1, -1) if "SYNCS.PHASECHK" in lines[i])
    e = next(i for i in range(start, len(lines)) if "SYNCS.ARRIVE" in lines[i])
    c = {}
    for line in lines[b : e + 1]:
        for pat in ("STL", "LDL", "BAR.SYNC", "HGMMA", "MUFU.EX2", "SHFL", "STS", "LDS", "WARPGROUP.DEPBAR"):
            if re.search(r"\b" + re.escape(pat), line):
                c[pat] = c.get(pat, 0) + 1
    return c


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sink", action="store_true")
    ap.add_argument("--topk-len", action="store_true")
    ap.add_argument("--pbs", type=int, default=64)
    ap.add_argument("--model1", action="store_true", help="the MODEL1 cache (d_qk 512)")
    ap.add_argument("--extra", action="store_true", help="with an extra cache")
    ap.add_argument("--heads", type=int, default=64, choices=(16, 32, 64), help="heads per CTA (16/32: narrow)")
    ap.add_argument(
        "--bf16-kv", action="store_true", help="the sparse prefill on bf16 kv rows (KV_BF16, with max_logits)"
    )
    ap.add_argument(
        "--max-logits", action="store_true", help="the sparse prefill's max_logits epilogue (implied by --bf16-kv)"
    )
    ap.add_argument(
        "--align", type=int, default=16, choices=(2, 4, 8, 16), help="--bf16-kv: bytes dividing every row address"
    )
    ap.add_argument("--pv-regs", type=int, default=sdg.HopperConfig().pv_regs)
    ap.add_argument("--producer-regs", type=int, default=None, help="default: the HopperConfig value for the head tile")
    ap.add_argument("--maxnreg", type=int, default=None, help="default: the HopperConfig value for the head tile")
    ap.add_argument("--producer-warps", type=int, default=None, help="warps of each producer partition")
    ap.add_argument("--half-stages", action="store_true", help="64-head tiles: three 32-token ring stages")
    ap.add_argument(
        "--narrow-rowsum", type=int, default=None, choices=(0, 1), help="16/32-head tiles: row sums once a request"
    )
    ap.add_argument(
        "--narrow-staged-out", type=int, default=None, choices=(0, 1), help="16/32-head tiles: Oᵀ through the Q tile"
    )
    ap.add_argument("--dump", default=None, help="directory for ttgir/ptx/sass")
    ap.add_argument(
        "--max-spill",
        type=int,
        default=256,
        help="spill bytes tolerated (ptxas total; the per-region SASS table shows where they are)",
    )
    a = ap.parse_args()
    if a.bf16_kv and a.extra:
        ap.error("--bf16-kv: the sparse prefill has no extra cache")
    if a.align != 16 and not a.bf16_kv:
        ap.error("--align: only with --bf16-kv")
    _register_defaults(a)
    if a.producer_warps is not None and a.producer_warps not in (1, 2, 4, 8):
        ap.error(f"--producer-warps: expected 1, 2, 4 or 8, got {a.producer_warps}")
    pow2 = a.pbs & (a.pbs - 1) == 0
    k = compile_kernel(
        a.sink,
        a.topk_len,
        pow2,
        a.pbs.bit_length() - 1 if pow2 else 0,
        a.producer_regs,
        a.maxnreg,
        model1=a.model1,
        extra=a.extra,
        heads=a.heads,
        bf16_kv=a.bf16_kv,
        align=a.align,
        max_logits=a.max_logits,
        pv_regs=a.pv_regs,
        producer_warps=a.producer_warps,
        half_stages=a.half_stages,
        narrow_rowsum=None if a.narrow_rowsum is None else bool(a.narrow_rowsum),
        narrow_staged_out=None if a.narrow_staged_out is None else bool(a.narrow_staged_out),
    )
    md = k.metadata
    print(
        f"triton: n_regs={k.n_regs if hasattr(k, 'n_regs') else None} shared={md.shared} B "
        f"(limit {SMEM_LIMIT}) num_warps={md.num_warps}"
    )
    dump = a.dump or tempfile.mkdtemp(prefix="gluon_sd_")
    os.makedirs(dump, exist_ok=True)
    for ext in ("ttgir", "llir", "ptx"):
        with open(os.path.join(dump, f"k.{ext}"), "w") as f:
            f.write(k.asm[ext])
    ptx = k.asm["ptx"]
    for pat in [
        "wgmma.mma_async",
        "wgmma.wait_group",
        "mbarrier.try_wait",
        "mbarrier.arrive",
        "setmaxnreg",
        "ld.global.v4",
        "ld.global",
        "st.shared.v4",
        "st.shared",
        "bar.sync",
        "bar.arrive",
        "fence.proxy.async",
        "cvt.rn.f16x2.e4m3x2",
        "cp.async.cg.shared.global",
        "cp.async.ca.shared.global",
        "cp.async.mbarrier.arrive",
        "ld.local",
        "st.local",
    ]:
        print(f"  ptx {pat:24s} {len(re.findall(re.escape(pat), ptx))}")
    ptx_path = os.path.join(dump, "k.ptx")
    cubin = os.path.join(dump, "k.cubin")
    r = subprocess.run(
        [os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", ptx_path, "-o", cubin], capture_output=True, text=True
    )
    if "Unsupported .version" in r.stderr and os.path.exists(os.path.join(BIN, "ptxas-blackwell")):
        # newer Triton (3.9) emits PTX that only its bundled CUDA 13 ptxas reads
        r = subprocess.run(
            [os.path.join(BIN, "ptxas-blackwell"), "-arch=sm_90a", "-v", ptx_path, "-o", cubin],
            capture_output=True,
            text=True,
        )
    print("ptxas rc", r.returncode)
    ok = r.returncode == 0
    for line in r.stderr.splitlines():
        if "registers" in line or "spill" in line or "error" in line.lower() or "warning" in line.lower():
            print("  " + line.strip())
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and (int(m.group(1)) > a.max_spill or int(m.group(2)) > a.max_spill):
            ok = False
    if r.returncode == 0:
        s = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
        with open(os.path.join(dump, "k.sass"), "w") as f:
            f.write(s)
        counts = {
            pat: len(re.findall(_sass_re(pat) if pat == "LDG" else pat, s))
            for pat in [
                "HGMMA",
                "WARPGROUP.ARRIVE",
                "WARPGROUP.DEPBAR",
                "SYNCS",
                "USETMAXREG",
                "LDG.E.128",
                "LDG",
                "LDGSTS.E",
                "STS.128",
                "STS",
                "LDL",
                "STL",
                "F2FP",
                "BAR.SYNC",
                "BAR.ARV",
            ]
        }
        for pat, c in counts.items():
            print(f"  sass {pat:18s} {c}")
        print("  per register region (USETMAXREG value: instruction counts):")
        for region, c in sass_regions(s):
            print(f"    {region:34s} {c}")
        loop = inner_loop_counts(s)
        print(f"  consumer inner loop (ready wait .. empty arrive): {loop}")
        if counts["HGMMA"] == 0:
            print("FAIL: no HGMMA in SASS")
            ok = False
    if md.shared > SMEM_LIMIT:
        print("FAIL: shared memory over the limit")
        ok = False
    print("dump:", dump)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
