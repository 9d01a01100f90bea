"""The Hopper kernel compiles for sm_90a on any machine (no GPU): ``scripts/gluon_compile_check.py``
(Triton's compiler and the ptxas shipped with it) for the bf16-row prefill producer (``KV_BF16``:
cp.async, and the register fallback for rows that are not 16-byte aligned) beside the FP8
cache's default variant, and the 64-head consumers split by role. The script fails on spills over 256 bytes, no HGMMA or shared memory
over the limit; these tests also check the producer's copies and the consumers' wgmmas are there."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gluon_compile_check.py")


def _ptxas() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return p if os.path.exists(p) else None


pytestmark = pytest.mark.skipif(_ptxas() is None, reason="needs Triton's bundled ptxas")


def run_check(*args: str, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, SCRIPT, *args, "--dump", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout + r.stderr
    return r.stdout


def count(report: str, what: str) -> int:
    m = re.search(r"^\s+" + re.escape(what) + r"\s+(\d+)$", report, re.M)
    assert m, f"{what!r} not in the report"
    return int(m.group(1))


@pytest.mark.parametrize("model1, copies", [(False, 36), (True, 32)])
def test_bf16_rows_producer_compiles_with_cp_async(model1, copies, tmp_path):
    # 16-byte copies per thread: 32 for the [64, 512] NoPE tile, 4 for the [64, 64] RoPE tile (V32)
    report = run_check("--bf16-kv", *(["--model1"] if model1 else []), tmp_path=tmp_path)
    assert count(report, "ptx cp.async.cg.shared.global") == copies
    assert count(report, "sass LDGSTS.E") == copies
    assert count(report, "ptx cp.async.mbarrier.arrive") == 1


def test_bf16_rows_register_fallback_compiles(tmp_path):
    report = run_check("--bf16-kv", "--align", "2", tmp_path=tmp_path)
    assert count(report, "sass LDGSTS.E") == 0


def test_fp8_cache_kernel_compiles_without_cp_async(tmp_path):
    report = run_check(tmp_path=tmp_path)
    assert count(report, "sass LDGSTS.E") == 0 and count(report, "ptx cvt.rn.f16x2.e4m3x2") > 0


def test_split_consumers_compile(tmp_path):
    # the default 64-head consumers, split by role: warpgroup 0 issues QKᵀ (32 NoPE + 4 RoPE
    # k-steps) and its half of P·V (4), warpgroup 1 the other half of P·V (4), at pv_regs
    report = run_check(tmp_path=tmp_path)
    assert count(report, "sass HGMMA") == 44
    assert re.search(r"TRY_ALLOC\.CTAPOOL 160 regs\s+\{[^}]*'HGMMA': 4\b", report), report


def test_prefill_stores_o_through_shared_memory(tmp_path):
    # the sparse prefill's 64-head consumers store O through the dead Q tile: each warp whole 512-byte
    # rows with 16-byte stores, 16 a thread in each warpgroup, for both kv forms; the decode keeps the
    # accumulator layout's stores (its partitions may hold several requests, whose Q is staged again)
    for args, n in ((("--max-logits", "--bf16-kv"), 32), (("--max-logits",), 32), ((), 0)):
        d = tmp_path / str(len(args))
        run_check(*args, tmp_path=d)
        assert (d / "k.sass").read_text().count("STG.E.128") == n, args


def test_decode_signals_its_dependent_after_its_stores(tmp_path):
    # programmatic dependent launch (the combine waits with griddepcontrol.wait): the decode
    # signals once, at the end of its default partition (SASS PREEXIT just before its EXIT)
    run_check(tmp_path=tmp_path)
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert ptx.count("griddepcontrol.launch_dependents") == 1


def test_pdl_only_on_cuda():
    import torch

    from sparse_mla.core.target import pdl_enabled

    assert pdl_enabled(torch.device("cpu")) is False


def test_hopper_config_rejects_bad_register_counts():
    from sparse_mla.decode.kernels.hopper import HopperConfig

    with pytest.raises(ValueError, match="HopperConfig.pv_regs: expected a positive int"):
        HopperConfig(pv_regs=0)
    with pytest.raises(ValueError, match="HopperConfig.producer_regs: expected a positive int"):
        HopperConfig(producer_regs=True)
    with pytest.raises(ValueError, match=r"HopperConfig.pv_regs: expected a multiple of 8 in \[24, 256\]"):
        HopperConfig(pv_regs=150)
    with pytest.raises(ValueError, match="HopperConfig.producer_regs: expected a multiple of 8"):
        HopperConfig(producer_regs=264)
    with pytest.raises(ValueError, match="warpgroup 0 would get"):
        HopperConfig(pv_regs=256, producer_regs=256)
    assert HopperConfig(pv_regs=152, producer_regs=136).pv_regs == 152  # 216 left: fine


def test_hopper_config_rejects_bad_16_head_tile_settings():
    from sparse_mla.decode.kernels.hopper import HopperConfig

    for w in (1, 3):  # one warp a partition: Triton pads the two to a warpgroup (8 warps, not 6)
        with pytest.raises(ValueError, match="narrow16_producer_warps: expected 2, 4 or 8"):
            HopperConfig(narrow16_producer_warps=w)
    with pytest.raises(ValueError, match="narrow16_producer_warps: expected a positive int"):
        HopperConfig(narrow16_producer_warps=0)
    # 20 warps at 168 registers each is past an SM's 65536
    with pytest.raises(ValueError, match=r"narrow16_maxnreg: expected a multiple of 8 of at most 96 .*20 warps"):
        HopperConfig(narrow16_producer_warps=8)
    # ptxas takes 175 as asked; the SM hands out 176 a thread: past 65536 at 12 warps
    with pytest.raises(ValueError, match="narrow16_maxnreg: expected a multiple of 8 of at most 168"):
        HopperConfig(narrow16_maxnreg=175)
    with pytest.raises(ValueError, match="HopperConfig.maxnreg: expected at most 168"):
        HopperConfig(maxnreg=255, producer_regs=256, pv_regs=256)
    with pytest.raises(ValueError, match="16-head consumer would get"):
        HopperConfig(narrow16_producer_warps=8, narrow16_maxnreg=96, narrow16_producer_regs=200)
    with pytest.raises(ValueError, match="narrow16_producer_regs: expected a multiple of 8"):
        HopperConfig(narrow16_producer_regs=84)
    c = HopperConfig(narrow16_producer_warps=8, narrow16_maxnreg=96, narrow16_producer_regs=80)
    assert c.narrow16_producer_warps == 8  # the consumer gets 160 registers


@pytest.mark.parametrize("warps, regs, maxnreg", [(4, 128, 168), (8, 80, 96)])
def test_16_head_tiles_compile(warps, regs, maxnreg, tmp_path):
    # the narrow consumer (68 wgmmas: 32 + 4 for Sᵀ = K Qᵀ, 32 for Oᵀ += Vᵀ Pᵀ) beside two
    # producer partitions of `warps` warps at `regs` registers
    report = run_check(
        "--heads", "16", "--producer-warps", str(warps), "--producer-regs", str(regs), "--maxnreg", str(maxnreg),
        tmp_path=tmp_path,
    )  # fmt: skip
    assert count(report, "sass HGMMA") == 68
    assert len(re.findall(rf"TRY_ALLOC\.CTAPOOL {regs} regs", report)) == 2, report


def test_smem_carveout_hint_checks():
    from sparse_mla.core.launcher import set_smem_carveout
    from sparse_mla.decode.kernels.hopper import HopperConfig

    for bad in (-2, 101, True, 50.0):
        with pytest.raises(ValueError, match="HopperConfig.smem_carveout: expected -1 or a percent"):
            HopperConfig(smem_carveout=bad)
        with pytest.raises(ValueError, match="percent: expected -1 or an int in 0..100"):
            set_smem_carveout(None, bad)
    assert HopperConfig(smem_carveout=0).smem_carveout == 0
    for bad in (1, "yes", 0.0):
        with pytest.raises(ValueError, match="HopperConfig.half_stages: expected a bool or None"):
            HopperConfig(half_stages=bad)
        with pytest.raises(ValueError, match="HopperConfig.narrow_rowsum: expected a bool or None"):
            HopperConfig(narrow_rowsum=bad)
        with pytest.raises(ValueError, match="HopperConfig.narrow_staged_out: expected a bool or None"):
            HopperConfig(narrow_staged_out=bad)
    set_smem_carveout(None, 0)  # the interpreter's launches have no compiled kernel: nothing to set

    class Stub:  # the host-time stub's compiled kernel: a name, not a driver handle
        function = "stub"

    set_smem_carveout(Stub(), 0)


@pytest.mark.parametrize(
    "args",
    [
        ("--heads", "16"),
        ("--heads", "32"),
        ("--heads", "16", "--model1", "--extra"),
        ("--heads", "64", "--half-stages"),
        ("--heads", "64", "--half-stages", "--bf16-kv"),
        ("--heads", "64", "--half-stages", "--model1", "--extra"),
    ],
)
def test_narrow_tiles_leave_l1_under_the_196_kb_carveout(args, tmp_path):
    # HopperConfig.smem_carveout = 0 (the default) gives the narrow tiles (and the 64-head tiles
    # with half_stages) the smallest carveout that fits (the driver adds 1 KB per CTA): at most
    # 196 KiB of shared memory leaves 60 KB of L1 for the producers' gathers (measured: 16-head
    # V3.2 b=128 193.8 -> 152.1 us against 28 KB; the 64-head producer alone 184 -> 152 us)
    report = run_check(*args, tmp_path=tmp_path)
    assert int(re.search(r"shared=(\d+) B", report).group(1)) + 1024 <= 196 * 1024


_COMPILE_WGMMA_PROBE = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from benchmarks import wgmma_probe as w
sig = {"out_ptr": "*fp32", "clk_ptr": "*i64", "iters": "i32", "N": "constexpr", "MODE": "constexpr", "WG": "constexpr"}
got = {}
for mode, n, wg in ((0, 8, 1), (1, 32, 2), (2, 16, 1), (0, 256, 2)):
    src = GluonASTSource(fn=w._wgmma_loop_kernel, signature=sig, constexprs={(3,): n, (4,): mode, (5,): wg})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4 * wg))
    ptx = k.asm["ptx"]
    got[f"{mode}-{n}-{wg}"] = [len(re.findall(r"wgmma\.mma_async", ptx)), len(re.findall(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*\{", ptx)),
                               "%clock64" in ptx]
print(json.dumps(got))
"""


def test_wgmma_probe_compiles():
    # benchmarks.wgmma_probe (the tensor core's rate from shared memory by N): four m64nNk16 a loop
    # step in every mode; the rs mode takes A from registers (its wgmma's A operand is a register
    # list), the others from shared memory; the loop is timed by clock64
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), ROOT, env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE_WGMMA_PROBE], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for key, (n_mma, n_reg_a, clock) in got.items():
        assert n_mma == 4 and clock, (key, got)
        assert (n_reg_a == 4) == key.startswith("2-"), (key, got)


def _inner_loop(report: str) -> dict:
    m = re.search(r"consumer inner loop \(ready wait \.\. empty arrive\): (\{.*\})", report)
    assert m, report
    return ast.literal_eval(m.group(1))  # (the script prints a dict of opcode counts)


def test_narrow_v32_decode_reduces_its_row_sums_once(tmp_path):
    # HopperConfig.narrow_rowsum: by default the V3.2 layout's 32-head consumer keeps its row sums
    # per thread (one cross-warp reduction a block less than the MODEL1 cache's, which keeps the
    # reduction a block: measured slower there); asked for, the MODEL1 build loses it too
    v32 = _inner_loop(run_check("--heads", "32", tmp_path=tmp_path / "v32"))
    m1 = _inner_loop(run_check("--heads", "32", "--model1", tmp_path=tmp_path / "m1"))
    assert v32["BAR.SYNC"] < m1["BAR.SYNC"] and v32["SHFL"] < m1["SHFL"], (v32, m1)
    m1_on = _inner_loop(run_check("--heads", "32", "--model1", "--narrow-rowsum", "1", tmp_path=tmp_path / "m1on"))
    assert m1_on["BAR.SYNC"] < m1["BAR.SYNC"] and m1_on["SHFL"] < m1["SHFL"], (m1_on, m1)
    # the sparse prefill's narrow V3.2 builds have it by default too (measured faster there), MODEL1's not
    pf = _inner_loop(run_check("--heads", "32", "--bf16-kv", tmp_path=tmp_path / "pf"))
    pf_off = _inner_loop(run_check("--heads", "32", "--bf16-kv", "--narrow-rowsum", "0", tmp_path=tmp_path / "pfoff"))
    assert pf["BAR.SYNC"] < pf_off["BAR.SYNC"] and pf["SHFL"] < pf_off["SHFL"], (pf, pf_off)


def test_narrow_staged_out_defaults():
    # HopperConfig.narrow_staged_out: None is on for the decode (every narrow row measured faster)
    # and the bf16-row prefill, off for the FP8 cache's prefill (2 % slower at 32
    # heads); never for 64-head tiles (their own staged epilogue is the prefill's, HAS_MAX_LOGITS)
    from sparse_mla.decode.kernels.hopper import BLOCK_H, resolve_narrow_staged_out

    assert resolve_narrow_staged_out(None, 32, kv_bf16=False, prefill=False)
    assert resolve_narrow_staged_out(None, 16, kv_bf16=True, prefill=True)
    assert not resolve_narrow_staged_out(None, 32, kv_bf16=False, prefill=True)
    assert resolve_narrow_staged_out(True, 32, kv_bf16=False, prefill=True)
    assert not resolve_narrow_staged_out(False, 16, kv_bf16=False, prefill=False)
    assert not resolve_narrow_staged_out(None, BLOCK_H, kv_bf16=False, prefill=False)
